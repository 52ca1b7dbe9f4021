"""Adapters to other RL libraries' vector-env APIs.

- :mod:`envfleet.adapters.sb3`: :class:`~envfleet.adapters.sb3.SB3VecEnv`, a
  stable-baselines3 ``VecEnv`` (``pip install 'envfleet[sb3]'``); over PettingZoo parallel
  envs, one row per agent (SuperSuit's layout).
- :mod:`envfleet.adapters.torchrl`: :class:`~envfleet.adapters.torchrl.FleetTorchRLEnv`, a
  TorchRL ``EnvBase`` over an envfleet vector env (``pip install 'envfleet[torchrl]'``).

Each module imports its library when imported; this package imports none of them.
"""
