"""A module that registers a gymnasium id when imported, for ``"module:EnvId"`` ids
(``envfleet.make("tests.envs_registered:EnvfleetTest/ShortCartPole-v0")``)."""

import gymnasium

ENV_ID = "EnvfleetTest/ShortCartPole-v0"

gymnasium.register(
    id=ENV_ID,
    entry_point="gymnasium.envs.classic_control.cartpole:CartPoleEnv",
    max_episode_steps=20,
)
