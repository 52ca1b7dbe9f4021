"""The core (the bottom layer of docs/architecture.md's table): what every layer above stands
on and nothing here imports from above. Errors, the cores this process may use, the optional
C step path, the control protocol, trees of arrays, the shared buffers and their layout, step
statistics, info assembly in gymnasium's convention, and the EnvGroup: K envs stepped over
their rows, the one step loop and autoreset implementation."""
