#!/bin/sh
# Run gymnasium's vector tests with its AsyncVectorEnv, then with envfleet (see README.md).
here=$(cd "$(dirname "$0")" && pwd)
exec "${PYTHON:-python}" "$here/run.py" "$@"
