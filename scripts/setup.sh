#!/usr/bin/env bash
# Installs what building and testing p2p-allreduce needs, once:
#  - a Rust toolchain with the standard library source, for the kernel build
#    (-Zbuild-std=core for nvptx64): Debian's rustc-web + cargo-web + rust-web-src,
#    unless the active toolchain already has rust-src;
#  - ptxas (from the PyPI wheel nvidia-cuda-nvcc-cu12) under .tools/, used by
#    the build to record register/spill counts and by tests/ptx.rs.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'setup: %s\n' "$*" >&2; }
die() { printf 'setup: ERROR: %s\n' "$*" >&2; exit 1; }

command -v cargo >/dev/null || die "cargo not found: install Rust (https://rustup.rs) first, then re-run."

has_src() { [ -f "$("$1" --print sysroot 2>/dev/null)/lib/rustlib/src/rust/library/core/src/lib.rs" ]; }

if [ -n "${P2P_ALLREDUCE_NVPTX_RUSTC:-}" ]; then
  has_src "$P2P_ALLREDUCE_NVPTX_RUSTC" || die "P2P_ALLREDUCE_NVPTX_RUSTC=$P2P_ALLREDUCE_NVPTX_RUSTC has no library source"
elif has_src rustc; then
  say "active toolchain has rust-src"
elif [ -x /usr/bin/rustc ] && has_src /usr/bin/rustc && [ -x /usr/bin/cargo ]; then
  say "using Debian rustc-web for the kernels ($(/usr/bin/rustc --version))"
else
  if command -v apt-get >/dev/null; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    [ -z "$SUDO" ] || command -v sudo >/dev/null || die "need root to apt-get install rustc-web cargo-web rust-web-src (or run: rustup component add rust-src)"
    say "installing Debian rustc-web cargo-web rust-web-src (kernel toolchain)"
    $SUDO apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q rustc-web cargo-web rust-web-src >/dev/null \
      || die "apt-get install rustc-web cargo-web rust-web-src failed; alternatively run: rustup component add rust-src"
    has_src /usr/bin/rustc || die "rust-web-src installed but /usr/lib/rustlib/src is missing"
  else
    die "no toolchain with the standard library source: run 'rustup component add rust-src' (or install Debian's rustc-web cargo-web rust-web-src)"
  fi
fi

PTXAS=.tools/cuda-nvcc/nvidia/cuda_nvcc/bin/ptxas
if [ -n "${P2P_ALLREDUCE_PTXAS:-}" ]; then
  [ -x "$P2P_ALLREDUCE_PTXAS" ] || die "P2P_ALLREDUCE_PTXAS=$P2P_ALLREDUCE_PTXAS is not an executable"
elif [ -x "$PTXAS" ]; then
  :
else
  PY=$(command -v python3 || true)
  [ -n "$PY" ] || die "python3 (with pip) is needed to fetch ptxas from PyPI: apt-get install -y python3-pip, or set P2P_ALLREDUCE_PTXAS"
  say "fetching ptxas (PyPI nvidia-cuda-nvcc-cu12==12.9.86, ~40 MB)"
  tmp=$(mktemp -d)
  "$PY" -m pip download -q --no-deps --only-binary=:all: nvidia-cuda-nvcc-cu12==12.9.86 -d "$tmp" \
    || die "pip download nvidia-cuda-nvcc-cu12==12.9.86 failed (network?); or set P2P_ALLREDUCE_PTXAS to a ptxas >= 12.8"
  mkdir -p .tools/cuda-nvcc
  "$PY" - "$tmp"/nvidia_cuda_nvcc_cu12-*.whl <<'PYEOF'
import sys, zipfile, os
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extract("nvidia/cuda_nvcc/bin/ptxas", ".tools/cuda-nvcc")
os.chmod(".tools/cuda-nvcc/nvidia/cuda_nvcc/bin/ptxas", 0o755)
PYEOF
  rm -rf "$tmp"
  "$PTXAS" --version >/dev/null || die "the unpacked ptxas does not run on this machine"
fi
say "ready"
