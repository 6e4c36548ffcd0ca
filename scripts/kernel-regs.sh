#!/usr/bin/env bash
# Registers, spills and stack of the kernel entries for one architecture,
# without the whole host build: the nested kernel build of build.rs (same
# flags) into target/kernel-regs/, then `ptxas -v` on the PTX. About 30 s
# per architecture once `core` is built; for trying a kernel change against
# the 128-register budget of 512-thread blocks before a full build.
#
#   scripts/kernel-regs.sh [ARCH] [PATTERN]   # ARCH: sm_120 (default), sm_90, sm_80
#                                             # PATTERN: grep -E over entry names (default: all)
#   KERNEL_REGS_TOP=20 scripts/kernel-regs.sh sm_90 rmsnorm_push_ll
#
# Prints the entries with the most registers and a summary; exits 1 when an
# entry uses more than 128 registers, spills or has a stack frame (the rule
# tests/ptx.rs enforces on every architecture).
set -euo pipefail
cd "$(dirname "$0")/.."
arch=${1:-sm_120}
pattern=${2:-.}
top=${KERNEL_REGS_TOP:-10}
bash scripts/setup.sh >/dev/null

has_src() { [ -f "$("$1" --print sysroot 2>/dev/null)/lib/rustlib/src/rust/library/core/src/lib.rs" ]; }
if [ -n "${P2P_ALLREDUCE_NVPTX_RUSTC:-}" ]; then
  rustc_bin=$P2P_ALLREDUCE_NVPTX_RUSTC
  cargo_bin=${P2P_ALLREDUCE_NVPTX_CARGO:-cargo}
elif has_src rustc; then
  rustc_bin=$(command -v rustc)
  cargo_bin=$(command -v cargo)
else
  rustc_bin=/usr/bin/rustc
  cargo_bin=/usr/bin/cargo
fi
ptxas=${P2P_ALLREDUCE_PTXAS:-.tools/cuda-nvcc/nvidia/cuda_nvcc/bin/ptxas}

out=target/kernel-regs
mkdir -p "$out"
ptx="$PWD/$out/$arch.ptx"
# As build.rs: the kernel crate alone, unstable features for this build only,
# no MIR jump threading (it can duplicate bar.sync into divergent branches).
(cd device && env -u RUSTFLAGS RUSTC="$rustc_bin" RUSTC_BOOTSTRAP=1 \
  RUSTFLAGS="-Zmir-enable-passes=-JumpThreading" \
  "$cargo_bin" rustc -q --release --lib --target nvptx64-nvidia-cuda -Zbuild-std=core \
  --target-dir "$PWD/../$out/build" -- --emit=asm="$ptx" -Ctarget-cpu="$arch")

report="$out/$arch.txt"
"$ptxas" -arch="$arch" -v -o /dev/null "$ptx" 2>&1 | python3 -c '
import re, sys
entry = None
rows = []
for line in sys.stdin:
    m = re.search(r"Compiling entry function .(\w+). for", line)
    if m:
        entry = m.group(1)
        continue
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and entry:
        stack, spill = int(m.group(1)), int(m.group(2)) + int(m.group(3))
        continue
    m = re.search(r"Used (\d+) registers", line)
    if m and entry:
        rows.append((int(m.group(1)), spill, stack, entry))
        entry = None
for regs, spill, stack, name in rows:
    print(regs, spill, stack, name)
' > "$report"
grep -E " [^ ]*(${pattern})[^ ]*$" "$report" | sort -n -r | head -n "$top" |
  awk '{printf "%4d registers  %4d spill bytes  %4d stack bytes  %s\n", $1, $2, $3, $4}'
total=$(wc -l < "$report")
bad=$(awk '$1 > 128 || $2 > 0 || $3 > 0' "$report" | wc -l)
max=$(sort -n -r "$report" | head -n 1 | cut -d" " -f1)
echo "$arch: $total entries, at most $max registers; $bad over 128 registers, spilling or with a stack frame (report: $report)"
[ "$bad" -eq 0 ]
