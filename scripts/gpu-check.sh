#!/usr/bin/env bash
# The GPU suite and the benchmark, for a GPU machine that cannot build
# (no network, no Rust there).
#
#   scripts/gpu-check.sh build   # here: builds release binaries into .carry/bin
#   scripts/gpu-check.sh run     # on the GPU machine, from the repo root:
#                                # runs them; logs go to $OUT (default ./gpu-logs)
#
# With the device tool: build here, then run `bash scripts/gpu-check.sh run`
# there with carry [".carry"].
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
build)
  bash scripts/setup.sh
  rm -rf .carry && mkdir -p .carry/bin
  exes() { python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])'; }
  cargo test --release --no-run --test gpu --features nccl --message-format=json | exes | while read -r name exe; do
    cp "$exe" ".carry/bin/test-$name"
  done
  cargo bench --no-run --bench allreduce --message-format=json | exes | while read -r name exe; do
    cp "$exe" ".carry/bin/bench-$name"
  done
  cargo build --release --bin p2p-allreduce
  cp target/release/p2p-allreduce .carry/bin/
  for need in test-gpu bench-allreduce p2p-allreduce; do
    [ -x ".carry/bin/$need" ] || { echo "gpu-check: build did not produce $need" >&2; exit 1; }
  done
  ls -la .carry/bin
  ;;
run)
  OUT=${OUT:-gpu-logs}
  mkdir -p "$OUT"
  B=.carry/bin
  [ -x "$B/test-gpu" ] || { echo "gpu-check: $B/test-gpu missing: run 'scripts/gpu-check.sh build' first and carry .carry" >&2; exit 2; }
  status=0
  # NCCL (feature `nccl` in test-gpu): cudarc looks for libnccl.so; the
  # nvidia-nccl wheel ships libnccl.so.2, so link it under that name.
  nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
  if [ -n "$nccl_dir" ] && [ -e "$nccl_dir/libnccl.so.2" ]; then
    mkdir -p /tmp/p2p-ar-nccl && ln -sf "$nccl_dir/libnccl.so.2" /tmp/p2p-ar-nccl/libnccl.so
    export LD_LIBRARY_PATH=/tmp/p2p-ar-nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
  export NCCL_NVLS_ENABLE=0
  { nvidia-smi || true; } > "$OUT/nvidia-smi.txt" 2>&1
  set -o pipefail
  echo "== gpu suite"; timeout "${GPU_SUITE_TIMEOUT:-400}" "$B/test-gpu" 2>&1 | tee "$OUT/gpu-suite.log" || status=1
  echo "== benchmark"; BENCH_OUT="$OUT/bench.md" timeout "${GPU_BENCH_TIMEOUT:-150}" "$B/bench-allreduce" 2>&1 | tee "$OUT/bench.log" || status=1
  if [ -x "$B/p2p-allreduce" ]; then
    echo "== cli (default: info, quick check, short bench)"; timeout 120 "$B/p2p-allreduce" 2>&1 | tee "$OUT/cli.log" || status=1
    echo "== cli check"; timeout 120 "$B/p2p-allreduce" check 2>&1 | tee "$OUT/check.log" || status=1
    echo "== cli bench"; timeout 180 "$B/p2p-allreduce" bench --world 2,4,8 -d bf16 \
      --plot "$OUT/latency.svg" --json "$OUT/bench.json" 2>&1 | tee -a "$OUT/check.log" || status=1
  fi
  exit $status
  ;;
*)
  echo "usage: $0 build|run" >&2; exit 2 ;;
esac
