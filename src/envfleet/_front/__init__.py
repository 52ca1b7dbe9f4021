"""The front (DESIGN §2, layer 1), private; see envfleet for the public names.

``make`` (make() and its argument checks), ``factories`` (env factories and their pickling),
``vector_env`` (the synchronous :class:`FleetVectorEnv`: the call-state machine), ``pool`` (the
first-ready pool, mixed into it), ``checks`` (call arguments), ``infos`` (gymnasium's info
convention, batched and unbatched), ``results`` (result buffers: copies, spare slabs).
"""
