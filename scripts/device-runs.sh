#!/usr/bin/env bash
# The device runs of issues 43, 45 and 48 (one GPU), from the repo root on
# the GPU machine,
# with release binaries built by `scripts/gpu-check.sh build` in .carry/bin
# and the binary of the commit to compare against as
# .carry/bin/p2p-allreduce-base. Logs go to $OUT (default ./gpu-logs).
#
#   scripts/device-runs.sh suite   # GPU suite, then base/new benches alternated
#   scripts/device-runs.sh sanitize   # compute-sanitizer over the changed kernels
#                                     # (SAN_QUICK=1: check --quick and the injected mismatches only)
#   scripts/device-runs.sh sanitize2  # the same over the two-process engine shapes, the fused op
#   scripts/device-runs.sh python [TESTS]  # the torch package's GPU tests (carried wheel)
#   AB="base new" ROUNDS=5 AB_GROUPS=3 scripts/device-runs.sh ab
#       # (not GROUPS: bash sets that to the user's group ids)
#       # builds alternated ROUNDS times, each over AB_GROUPS groups per world (.carry/bin/p2p-allreduce-<build>;
#       # `new` is .carry/bin/p2p-allreduce), summarised by scripts/ab_summary.py;
#       # AB_ALGOS (bench --algo, default all) and AB_TAG (names the summary and archive) optional
#   NCU_BUILDS="base new" NCU_KERNEL=allreduce_push_ll_bf16_w8_virtual NCU_ALGO=push_ll NCU_WORLD=8 \
#     scripts/device-runs.sh ncu
#       # Nsight Compute over NCU_KERNEL of each build (10 launches at 4 KiB, no cache
#       # flush, no clock lock), one CSV per build
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
B=.carry/bin
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
status=0
step() { # name timeout command...
  local name=$1 t=$2; shift 2
  echo "== $name ($(date +%T))"
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1 || { echo "== $name: FAILED (exit $?)"; status=1; }
  tail -n 3 "$OUT/$name.log"
}
# The binary of build $1: .carry/bin/p2p-allreduce-<build>, `new` the
# plain .carry/bin/p2p-allreduce.
build_bin() { if [ "$1" = new ]; then echo "$B/p2p-allreduce"; else echo "$B/p2p-allreduce-$1"; fi; }
# The builds named in $AB (default "base new") alternated $ROUNDS times
# (default 5), each run over $AB_GROUPS groups per world (default 1); the
# summary and one archive are rewritten after every round, so that a call
# cut short still brings back the rounds it finished (few files come back).
ab_runs() {
  local tag=${AB_TAG:-ab}
  mkdir -p "$OUT/$tag"
  local i v bin algos=()
  [ -n "${AB_ALGOS:-}" ] && algos=(--algo "$AB_ALGOS")
  for i in $(seq 1 "${ROUNDS:-5}"); do
    for v in ${AB:-base new}; do
      bin=$(build_bin "$v")
      step "$tag/bench-$v-$i" $((100 * ${AB_GROUPS:-1})) "$bin" bench --world 2,8 -b 4K -e 64K -f 16 -n 100 "${algos[@]}" --groups "${AB_GROUPS:-1}" --json "$OUT/$tag/bench-$v-$i.json"
    done
    python3 scripts/ab_summary.py "$OUT/$tag" ${AB:-base new} > "$OUT/$tag-summary.md"
    tar -C "$OUT" -czf "$OUT/$tag.tgz" "$tag"
  done
  [ -f "$OUT/$tag-summary.md" ] && cat "$OUT/$tag-summary.md"
  rm -rf "${OUT:?}/$tag"
}
case "${1:-}" in
suite)
  nvidia-smi -L > "$OUT/nvidia-smi.txt" 2>&1
  step gpu-suite 330 "$B/test-gpu"
  grep -E "^test |^gpu:" "$OUT/gpu-suite.log"
  # Issue 45's examples: two ranks on GPU 0, bit for bit against the CPU.
  step tp-mlp-threads 120 "$B/tp_mlp_threads" --world 2 --gpu 0
  step tp-mlp-processes 120 "$B/tp_mlp_processes" --world 2 --gpu 0
  # Cost: base and new alternated, virtual ranks, 4 KiB and 64 KiB (ROUNDS=0: none).
  AB="base new" ROUNDS=${ROUNDS:-3} ab_runs
  ;;
sanitize)
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer)
  san() { local name=$1 tool=$2; shift 2; local extra=()
    [ "$tool" = racecheck ] && extra=(--racecheck-report all)
    step "san-$name-$tool" 200 "$CS" --tool "$tool" "${extra[@]}" --error-exitcode 1 --print-limit 20 "$@"; }
  for tool in memcheck racecheck synccheck initcheck; do
    san check-quick "$tool" "$B/p2p-allreduce" check --quick
    san injected "$tool" "$B/test-gpu" ranks_that_disagree_injected
    [ "${SAN_QUICK:-0}" = 1 ] || san peer-group "$tool" "$B/test-gpu" peer_group_one_gpu
  done
  [ "${SAN_QUICK:-0}" = 1 ] || san fused-split racecheck "$B/test-gpu" fused_push_ll_split
  ;;
sanitize2)
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer)
  san() { local name=$1 tool=$2; shift 2; local extra=()
    [ "$tool" = racecheck ] && extra=(--racecheck-report all)
    step "san-$name-$tool" 240 "$CS" --tool "$tool" "${extra[@]}" --error-exitcode 1 --print-limit 20 "$@"; }
  for tool in memcheck synccheck; do
    san engine-shapes "$tool" "$B/test-gpu" ranks_that_disagree_at_engine
  done
  san fused memcheck "$B/test-gpu" fused_add_rmsnorm_bit_exact
  san shared-host memcheck "$B/test-gpu" shared_host
  ;;
python)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/p2p-site .carry/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/p2p-site PYTHONUNBUFFERED=1
  # An optional second argument picks tests, e.g.
  # test_gpu.GpuTests.test_two_processes_on_gpu0_calls_that_differ.
  step python-gpu-tests 500 bash -c "cd python/tests && python3 -m unittest -v ${2:-test_gpu}"
  cat "$OUT/python-gpu-tests.log" | tail -n 40
  ;;
ab)
  nvidia-smi -L > "$OUT/nvidia-smi.txt" 2>&1
  ab_runs
  ;;
ncu)
  NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
  for v in ${NCU_BUILDS:-base new}; do
    bin=$(build_bin "$v")
    step "ncu-$v" 300 "$NCU" --kernel-name "${NCU_KERNEL:-allreduce_push_ll_bf16_w8_virtual}" --launch-skip 40 --launch-count 10 \
      --cache-control none --clock-control none --section SpeedOfLight --section LaunchStats \
      --section WarpStateStats --section InstructionStats --section SchedulerStats --csv --page details \
      "$bin" bench --world "${NCU_WORLD:-8}" --algo "${NCU_ALGO:-push_ll}" -b 4K -e 4K -n 5 --no-check
  done
  (cd "$OUT" && tar -czf ncu.tgz ncu-*.log && rm -f ncu-*.log)
  ;;
*) echo "usage: $0 suite|sanitize|sanitize2|python|ab|ncu" >&2; exit 2 ;;
esac
exit $status
