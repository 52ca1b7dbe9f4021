"""The Sampler (a layer of docs/architecture.md's table): ``sampler`` (the public
:class:`envfleet.Sampler`), the two kinds of inference and the calibrated default over them,
the recorders of rollouts and their multi-agent split. It samples a vector env of the front."""
