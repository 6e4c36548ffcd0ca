#!/usr/bin/env bash
# The torch-facing package's tests: builds the wheel (scripts/wheel.sh),
# installs it into .tools/py and runs python/tests. Without torch or a GPU
# the GPU tests print why they are skipped; the rest need neither.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/wheel.sh >/dev/null
WHEEL=$(ls -t .whl/p2p_allreduce-*.whl | head -1)
.tools/py/bin/pip install -q --force-reinstall --no-deps "$WHEEL"
# From outside the source tree, so the installed package is the one tested.
cd python/tests && ../../.tools/py/bin/python -m unittest discover -v -s . -p 'test_*.py'
