"""The front (DESIGN §2, layer 1): ``make()`` and the vector env, private; see envfleet."""
