"""The front (docs/architecture.md's layer table), private; see envfleet for the public names.

``make`` (make() and its argument checks), ``factories`` (env factories and their pickling),
``vector_env`` (the synchronous :class:`FleetVectorEnv`: the call-state machine), ``pool`` (the
first-ready pool, mixed into it), ``checks`` (call arguments), ``results`` (result buffers:
copies, spare slabs), ``multi_agent`` and ``multi_agent_vector_env`` (PettingZoo parallel envs,
agents batched), ``process_env`` (:class:`envfleet.ProcessEnv`). Info assembly is the core's
(``envfleet._core.infos``).
"""
