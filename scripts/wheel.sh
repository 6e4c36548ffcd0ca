#!/usr/bin/env bash
# Builds the torch-facing wheel (python/: PyO3, abi3, one wheel for CPython
# 3.9+) into .whl/, for the oldest glibc the toolchain allows: manylinux2014
# (glibc 2.17, so RHEL 7/8/9, Ubuntu 18.04+), linked with zig (PyPI's
# `ziglang`) against glibc 2.17's symbols. Installs what it needs first: the
# kernel toolchain (scripts/setup.sh), maturin, ziglang and auditwheel, in a
# virtual environment under .tools/py. Extra arguments go to `maturin build`.
# P2P_ALLREDUCE_WHEEL_NATIVE=1 builds with the system linker instead (the
# wheel is then tagged for this machine's glibc).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
[ -x .tools/py/bin/python ] || "$PY" -m venv .tools/py
if ! .tools/py/bin/python -c 'import ziglang, auditwheel' 2>/dev/null || [ ! -x .tools/py/bin/maturin ]; then
  .tools/py/bin/pip install -q 'maturin>=1.5,<2' 'ziglang==0.17.1' 'auditwheel>=6,<7'
fi
LINK=(--zig --compatibility manylinux2014)
[ "${P2P_ALLREDUCE_WHEEL_NATIVE:-0}" = 1 ] && LINK=()
# The root target directory: the kernels are built once for both crates.
# maturin finds zig as `python -m ziglang` of the first python on PATH.
PATH="$PWD/.tools/py/bin:$PATH" CARGO_TARGET_DIR="$PWD/target" .tools/py/bin/maturin build --release \
  --manifest-path python/Cargo.toml --out .whl "${LINK[@]}" "$@"
ls -1 .whl/*.whl
