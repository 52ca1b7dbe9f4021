#!/bin/sh
# Run stable-baselines3's vec-env tests with its SubprocVecEnv, then with envfleet (README.md).
here=$(cd "$(dirname "$0")" && pwd)
exec "${PYTHON:-python}" "$here/run.py" "$@"
