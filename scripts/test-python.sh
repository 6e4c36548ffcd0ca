#!/usr/bin/env bash
# The torch-facing package's tests: builds the wheel (scripts/wheel.sh),
# installs it into .tools/py and runs python/tests. Without torch or a GPU
# the GPU tests print why they are skipped; the rest need neither.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/wheel.sh >/dev/null
WHEEL=$(ls -t .whl/p2p_allreduce-*.whl | head -1)
# The wheel installs on glibc 2.28 or older (manylinux_2_28 and below):
# auditwheel reads the symbol versions the extension needs.
if [ "${P2P_ALLREDUCE_WHEEL_NATIVE:-0}" != 1 ]; then
  SHOW=$(.tools/py/bin/auditwheel show "$WHEEL")
  echo "$SHOW" | tr '\n' ' ' | grep -Eq 'consistent with the following platform tag: *"manylinux_2_(1[0-9]|2[0-8])_x86_64"' \
    || { echo "test-python: $WHEEL needs a newer glibc than 2.28:" >&2; echo "$SHOW" >&2; exit 1; }
  echo "test-python: $(basename "$WHEEL"): $(stat -c %s "$WHEEL") bytes; auditwheel: $(echo "$SHOW" | tr '\n' ' ' | grep -Eo '"manylinux_2_[0-9]+_x86_64"' | head -1)"
fi
.tools/py/bin/pip install -q --force-reinstall --no-deps "$WHEEL"
# From outside the source tree, so the installed package is the one tested.
cd python/tests && ../../.tools/py/bin/python -m unittest discover -v -s . -p 'test_*.py'
