#!/usr/bin/env python3
"""Summarises `p2p-allreduce bench --json` runs of several builds alternated
in one device call (scripts/device-runs.sh ab): per cell, every run's median,
the median of those medians per build, and each build's median minus the
first build's. Files are named bench-<build>-<round>.json.

    python3 scripts/ab_summary.py DIR [BUILD ...]
"""
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def load(directory):
    runs = defaultdict(lambda: defaultdict(list))  # build -> cell -> [us]
    for f in sorted(Path(directory).glob("bench-*-*.json")):
        m = re.fullmatch(r"bench-(.+)-(\d+)\.json", f.name)
        if not m:
            continue
        for row in json.loads(f.read_text()):
            if row.get("wrong") not in (0, None):
                sys.exit(f"{f}: {row['wrong']} wrong elements in {row}")
            cell = (row["world"], row["size"], row["requested"])
            runs[m.group(1)][cell].append(row["time_us"])
    return runs


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    runs = load(sys.argv[1])
    builds = sys.argv[2:] or sorted(runs)
    missing = [b for b in builds if b not in runs]
    if missing:
        sys.exit(f"no runs of {missing} in {sys.argv[1]} (found {sorted(runs)})")
    first = builds[0]
    cells = sorted(set().union(*(runs[b].keys() for b in builds)))
    head = ["world", "size", "algorithm"]
    for b in builds:
        head += [f"{b} (runs)", f"{b} median"]
    head += [f"{b} - {first}" for b in builds[1:]]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for cell in cells:
        world, size, algo = cell
        kib = f"{size // 1024} KiB" if size % 1024 == 0 else f"{size} B"
        out = [str(world), kib, algo]
        med = {}
        for b in builds:
            xs = runs[b].get(cell, [])
            med[b] = statistics.median(xs) if xs else float("nan")
            out += [" / ".join(f"{x:.2f}" for x in xs), f"{med[b]:.2f}"]
        out += [f"{med[b] - med[first]:+.2f}" for b in builds[1:]]
        print("| " + " | ".join(out) + " |")


if __name__ == "__main__":
    main()
