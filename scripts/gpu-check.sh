#!/usr/bin/env bash
# The GPU suite and the benchmark, for a GPU machine that cannot build
# (no network, no Rust there).
#
#   scripts/gpu-check.sh build   # here: builds release binaries into .carry/bin
#   scripts/gpu-check.sh run     # on the GPU machine, from the repo root:
#                                # runs them; logs go to $OUT (default ./gpu-logs)
#   scripts/gpu-check.sh soak [virtual|procs|both]
#                                # on the GPU machine: `p2p-allreduce soak` on
#                                # virtual ranks and/or two processes on GPU 0
#                                # (minutes; SOAK_BUDGET seconds each, default 200)
#
# With the device tool: build here, then run `bash scripts/gpu-check.sh run`
# there with carry [".carry"].
#
# GPU_CHECK_MPS=1 (run's Python steps, and soak): where two ranks share GPU
# 0, start an MPS control daemon first (its logs in $OUT/mps-log) and stop
# it at the end, so that the two processes' kernels run at once instead of
# time-slicing (docs/benchmarks.md: the decode step and the two-process soak
# were measured that way).
set -euo pipefail
cd "$(dirname "$0")/.."

start_mps() {
  [ "${GPU_CHECK_MPS:-0}" = 1 ] || return 0
  command -v nvidia-cuda-mps-control >/dev/null \
    || { echo "gpu-check: GPU_CHECK_MPS=1 but no nvidia-cuda-mps-control on PATH" >&2; exit 2; }
  # The pipes under /tmp (a short path: they are Unix sockets), the logs in $OUT.
  CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/p2p-mps.XXXXXX)
  CUDA_MPS_LOG_DIRECTORY="$(cd "$OUT" && pwd)/mps-log"
  export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  mkdir -p "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "gpu-check: the MPS control daemon did not start" >&2; exit 2; }
  trap 'echo quit | nvidia-cuda-mps-control || true; rm -rf "$CUDA_MPS_PIPE_DIRECTORY"' EXIT
  echo "== MPS control daemon started (pipes in $CUDA_MPS_PIPE_DIRECTORY)"
}

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
  # Only the suite and the bench (the device tool carries at most 64 MiB).
  cargo test --release --no-run --test gpu --features nccl --message-format=json | exes | while read -r name exe; do
    if [ "$name" = gpu ]; then cp "$exe" ".carry/bin/test-$name"; fi
  done
  cargo bench --no-run --bench allreduce --message-format=json | exes | while read -r name exe; do
    if [ "$name" = allreduce ]; then cp "$exe" ".carry/bin/bench-$name"; fi
  done
  cargo build --release --features cli --bin p2p-allreduce
  cp target/release/p2p-allreduce .carry/bin/
  # The torch package, for the Python GPU tests and the decode-step bench.
  bash scripts/wheel.sh >/dev/null
  mkdir -p .carry/whl && cp "$(ls -t .whl/p2p_allreduce-*.whl | head -1)" .carry/whl/
  for need in test-gpu bench-allreduce p2p-allreduce; do
    [ -x ".carry/bin/$need" ] || { echo "gpu-check: build did not produce $need" >&2; exit 1; }
  done
  ls -la .carry/bin
  ;;
run)
  OUT=${OUT:-gpu-logs}
  mkdir -p "$OUT"
  B=.carry/bin
  [ -x "$B/test-gpu" ] || [ "${GPU_CHECK_ONLY:-}" = python ] \
    || { echo "gpu-check: $B/test-gpu missing: run 'scripts/gpu-check.sh build' first and carry .carry" >&2; exit 2; }
  status=0
  # libnccl is found by the library itself (LD_LIBRARY_PATH, else the
  # nvidia-nccl wheels of the Pythons on PATH): no link is made here.
  # NVLink multicast stays off on shared multi-GPU hosts.
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  { nvidia-smi; nvidia-smi topo -m; } > "$OUT/nvidia-smi.txt" 2>&1 || true
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  set -o pipefail
  step() { # name timeout command...
    local name=$1 t=$2; shift 2
    echo "== $name"
    timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log" || { echo "== $name: FAILED (exit $?)"; status=1; }
  }
  python_steps() {
    # The torch package (carried wheel) into a private site dir; torch is the machine's.
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/p2p-site .carry/whl/*.whl \
      || { echo "== python: wheel install FAILED"; status=1; return; }
    export PYTHONPATH=/tmp/p2p-site PYTHONUNBUFFERED=1
    step python-gpu-tests 900 bash -c 'cd python/tests && python3 -m unittest -v test_gpu test_no_gpu test_bench_tp'
    # The decode step (issue 30): two ranks per GPU pair; on one GPU, two ranks share GPU 0.
    local g=0,0; [ "$ngpu" -ge 2 ] && g=0,1
    step bench-tp-deepseek 600 python3 python/bench/bench_tp.py --gpus $g --model deepseek-v3-dense \
      --reps "${TP_REPS:-10}" --json "$OUT/bench-tp-deepseek.json" --svg "$OUT/bench-tp-deepseek.svg"
    local l70=""; [ "$g" = 0,0 ] && l70="--layers 40"
    step bench-tp-llama 600 python3 python/bench/bench_tp.py --gpus $g --model llama-70b $l70 \
      --reps "${TP_REPS:-10}" --json "$OUT/bench-tp-llama.json" --svg "$OUT/bench-tp-llama.svg"
    step bench-tp-verify 300 python3 python/bench/bench_tp.py --gpus $g --model deepseek-v3-dense \
      --pattern verify --reps 20 --json "$OUT/bench-tp-verify.json"
  }
  # MPS (GPU_CHECK_MPS=1) for the Python steps only: the suite and the
  # sanitizers run as they always have, each process alone on the GPU.
  if [ "${GPU_CHECK_ONLY:-}" = python ]; then start_mps; python_steps; exit $status; fi
  step gpu-suite "${GPU_SUITE_TIMEOUT:-400}" "$B/test-gpu"
  if [ "${GPU_CHECK_QUICK:-0}" = 1 ]; then exit $status; fi
  step cli-check 150 "$B/p2p-allreduce" check --quick
  # NVIDIA's compute-sanitizer (docs/sanitizers.md): racecheck over the
  # fused push_ll split over clusters; every tool over every kernel family:
  # `check --quick` (every algorithm, virtual ranks, worlds 2, 3, 8), the
  # PeerGroup case (every algorithm's real-rank entries and the fused call
  # in place, two ranks on GPU 0) and the fused op's case. Each must report
  # 0 errors (exit 1 on any). Off with GPU_CHECK_SANITIZER=0; per-step
  # timeout GPU_SANITIZER_TIMEOUT.
  if [ "${GPU_CHECK_SANITIZER:-1}" = 1 ]; then
    CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
    if [ -z "$CS" ]; then
      echo "== sanitizer: not run (no compute-sanitizer on PATH or in /usr/local/cuda/bin)"
    else
      ST=${GPU_SANITIZER_TIMEOUT:-600}
      san() { # name tool command...
        local name=$1 tool=$2; shift 2
        local extra=()
        [ "$tool" = racecheck ] && extra=(--racecheck-report all)
        step "sanitizer-$name" "$ST" "$CS" --tool "$tool" "${extra[@]}" --error-exitcode 1 --print-limit 20 "$@"
      }
      san racecheck-fused-split racecheck "$B/test-gpu" fused_push_ll_split
      for tool in memcheck racecheck synccheck initcheck; do
        san "$tool-check-quick" "$tool" "$B/p2p-allreduce" check --quick
        san "$tool-peer-group" "$tool" "$B/test-gpu" peer_group_one_gpu
        san "$tool-fused" "$tool" "$B/test-gpu" fused_add_rmsnorm_bit_exact
      done
    fi
  fi
  if [ "$ngpu" -ge 2 ]; then
    step check-gpus 300 "$B/p2p-allreduce" check --gpus 0,1
    step check-procs 300 "$B/p2p-allreduce" check --procs --gpus 0,1
    step bench-gpus 300 "$B/p2p-allreduce" bench --gpus 0,1 -b 4K -e 64M \
      --json "$OUT/bench-gpus.json" --plot "$OUT/bench-gpus.svg"
    step bench-procs 300 "$B/p2p-allreduce" bench --procs --gpus 0,1 -b 4K -e 64M --json "$OUT/bench-procs.json"
    # Issue 14's target: fused vs plain vs unfused, rows 1..512 of 7168
    # bf16 on two GPUs, with each cluster size beside Auto's.
    step bench-fused-gpus 300 "$B/p2p-allreduce" bench --fused --gpus 0,1 \
      --fused-ctas 1,2,4,8 --json "$OUT/bench-fused-gpus.json"
  else
    echo "== two-GPU steps: not run ($ngpu GPU)"
  fi
  if [ "${GPU_CHECK_PYTHON:-1}" = 1 ]; then start_mps; python_steps; fi
  if [ "${GPU_CHECK_VIRTUAL_BENCH:-0}" = 1 ]; then
    step bench-virtual 180 "$B/bench-allreduce"
  fi
  exit $status
  ;;
soak)
  # `soak [virtual|procs|both]`: each well under ten minutes with the
  # default budget (SOAK_BUDGET seconds of timed replays, default 200).
  OUT=${OUT:-gpu-logs}
  mkdir -p "$OUT"
  B=.carry/bin
  [ -x "$B/p2p-allreduce" ] || { echo "gpu-check: $B/p2p-allreduce missing: run 'scripts/gpu-check.sh build' first and carry .carry" >&2; exit 2; }
  start_mps
  status=0
  budget=${SOAK_BUDGET:-200}
  which=${2:-both}
  set -o pipefail
  if [ "$which" = virtual ] || [ "$which" = both ]; then
    echo "== soak-virtual"
    timeout $((budget + 300)) "$B/p2p-allreduce" soak --budget "$budget" --json "$OUT/soak-virtual.json" 2>&1 \
      | tee "$OUT/soak-virtual.log" || { echo "== soak-virtual: FAILED"; status=1; }
  fi
  if [ "$which" = procs ] || [ "$which" = both ]; then
    echo "== soak-procs-gpu0"
    timeout $((budget + 300)) "$B/p2p-allreduce" soak --procs --gpus 0,0 --budget "$budget" \
      --json "$OUT/soak-procs.json" 2>&1 | tee "$OUT/soak-procs.log" || { echo "== soak-procs-gpu0: FAILED"; status=1; }
  fi
  exit $status
  ;;
*)
  echo "usage: $0 build|run|soak" >&2; exit 2 ;;
esac
