#!/usr/bin/env bash
# Mutation check: builds the test suites against deliberately broken
# kernels and shows that they fail. Each mutant lives in its own git
# worktree under $TMPDIR, so the real tree is never touched.
#
#   scripts/mutation-check.sh cpu     # CPU suites here (cpu_properties, loom)
#   scripts/mutation-check.sh build   # GPU suite binaries into .carry/mut-<name>
#   scripts/mutation-check.sh run     # on the GPU machine: each mutant must FAIL
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
TMP=${TMPDIR:-/tmp}/p2p-ar-mutants
MUTANTS="order seed barrier"

mutate() { # name dir
  python3 - "$1" "$2" <<'PY'
import sys
name, d = sys.argv[1], sys.argv[2]
def patch(path, old, new):
    p = f"{d}/{path}"; s = open(p).read()
    assert old in s, f"{name}: pattern not found in {path}"
    open(p, "w").write(s.replace(old, new, 1))
if name == "order":      # add ranks in reverse order
    patch("device/src/reduce.rs",
          "    let mut acc = E::unpack(packs[0]);\n    let mut r = 1;\n    while r < N {\n        let x = E::unpack(packs[r]);",
          "    let mut acc = E::unpack(packs[N - 1]);\n    let mut r = 1;\n    while r < N {\n        let x = E::unpack(packs[N - 1 - r]);")
elif name == "seed":     # seed the accumulator with +0.0
    patch("device/src/reduce.rs",
          "    let mut acc = E::unpack(packs[0]);\n    let mut r = 1;\n    while r < N {",
          "    let mut acc = [0.0f32; 8];\n    let mut r = 0;\n    while r < N {")
elif name == "barrier":  # skip the two-stage Mid barrier (pull.rs)
    patch("device/src/kernels/pull.rs",
          "            barrier_site::<N, TWO_STAGE>(a, own_sig, rank, block, BarrierKind::Mid, epoch)\n        };",
          "            true || barrier_site::<N, TWO_STAGE>(a, own_sig, rank, block, BarrierKind::Mid, epoch)\n        };")
PY
}

prepare() { # name -> worktree path
  local d="$TMP/$1"
  git worktree remove --force "$d" >/dev/null 2>&1 || true
  git worktree add --detach "$d" HEAD >/dev/null
  mkdir -p "$d/.tools" && cp -r "$ROOT/.tools/." "$d/.tools/" 2>/dev/null || true
  mutate "$1" "$d"
  echo "$d"
}

case "${1:-}" in
cpu)
  for m in order seed; do
    d=$(prepare $m)
    echo "== mutant $m: cpu_properties (must fail)"
    if (cd "$d" && CARGO_TARGET_DIR="$TMP/target" cargo test --release --test cpu_properties 2>&1 | tail -15); then :; fi
    git worktree remove --force "$d"
  done ;;
build)
  for m in $MUTANTS; do
    d=$(prepare $m)
    (cd "$d" && CARGO_TARGET_DIR="$TMP/target" cargo test --release --no-run --test gpu --message-format=json) \
      | python3 -c 'import json,sys
for l in sys.stdin:
    try: m=json.loads(l)
    except ValueError: continue
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="gpu": print(m["executable"])' \
      | while read -r exe; do mkdir -p .carry/mut && cp "$exe" ".carry/mut/gpu-$m"; done
    git worktree remove --force "$d"
  done
  ls -la .carry/mut ;;
run)
  OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
  for m in $MUTANTS; do
    echo "== mutant $m (must fail)"
    GPU_PROPERTY_CASES=200 timeout 200 ".carry/mut/gpu-$m" sweep property one_stage_equals graph_replay 2>&1 | tee "$OUT/mutant-$m.log" | grep -E "FAILED|gpu suite" | cut -c1-400 || true
  done ;;
*) echo "usage: $0 cpu|build|run" >&2; exit 2 ;;
esac
