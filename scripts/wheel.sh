#!/usr/bin/env bash
# Builds the torch-facing wheel (python/: PyO3, abi3, one wheel for CPython
# 3.9+) into .whl/. Installs what it needs first: the kernel toolchain
# (scripts/setup.sh) and maturin, in a virtual environment under .tools/py.
# Extra arguments go to `maturin build`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
if [ ! -x .tools/py/bin/maturin ]; then
  "$PY" -m venv .tools/py
  .tools/py/bin/pip install -q 'maturin>=1.5,<2'
fi
# The root target directory: the kernels are built once for both crates.
CARGO_TARGET_DIR="$PWD/target" .tools/py/bin/maturin build --release \
  --manifest-path python/Cargo.toml --out .whl "$@"
ls -1 .whl/*.whl
