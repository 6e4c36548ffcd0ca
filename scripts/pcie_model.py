#!/usr/bin/env python3
"""The traffic model of docs/pcie.md: predicted allreduce time per algorithm
on a PCIe box (default: 8 x RTX PRO 6000, two switches of 4), from a few
link figures. Every parameter is a command-line option, so the table can be
redone with better figures; the output is the Markdown table of the doc.

T = t0 + trips * delta + max(bytes_per_gpu / B_gpu, cross_island_bytes / B_up)

All numbers are predictions, not measurements.
"""
import argparse


def algorithms(n, island):
    """Per algorithm: (trips on the critical path, bytes in or out of one
    GPU per direction in units of M, bytes over one island uplink per
    direction in units of M, reads?)."""
    i = island
    cross = i * (n - i)  # rank pairs across the uplink, one direction
    return {
        # Start barrier, a read round trip (2 one-way trips), End barrier.
        "one_stage": (4, n - 1, cross, True),
        # Start, read round trip, Mid, read round trip.
        "two_stage": (6, 2 * (n - 1) / n, 2 * cross / n, True),
        # Data (one way), then the released flag (one way, after the data).
        "push": (2, n - 1, cross, False),
        # Data and flag in one: one way; every line carries 8 data bytes in 16.
        "push_ll": (1, 2 * (n - 1), 2 * cross, False),
        # Data, flag (Start), data, flag (Mid).
        "push_two_stage": (4, 2 * (n - 1) / n, 2 * cross / n, False),
        # Islands of n // 2 ranks (the algorithm's split; the model assumes
        # it is also the switch split): scatter + Start, f32 partials across
        # + Mid, results back + Back, relay in island A + Relay. A rank of
        # island A sends (h-1)/h M, 2/h M of f32 partials (16-bit types) and
        # (h-1)/h M; one uplink direction carries the partials, 2 M, the
        # other the results, M.
        "push_islands": (8, 2.0, 2.0 if cross else 0.0, False),
    }


def fmt_size(b):
    for unit, s in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= s and b % s == 0:
            return f"{b // s} {unit}"
    return f"{b / 1000:.0f} KB" if b >= 1000 else f"{b} B"


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--island", type=int, default=4, help="GPUs per switch")
    p.add_argument("--t0", type=float, default=2.2, help="kernel floor, us")
    p.add_argument("--delta", type=float, default=1.0, help="one-way PCIe trip, us")
    p.add_argument("--write-gbps", type=float, default=25.4)
    p.add_argument("--read-gbps", type=float, default=20.6)
    p.add_argument("--uplink-gbps", type=float, default=25.4)
    a = p.parse_args()
    n = a.ranks
    algos = algorithms(n, a.island)
    sizes = [43008] + [4096 << k for k in range(0, 15, 2)]
    print("| size | " + " | ".join(algos) + " | fastest |")
    print("|---" * (len(algos) + 2) + "|")
    for m in sizes:
        row = []
        for name, (trips, per_gpu, uplink, reads) in algos.items():
            bw = (a.read_gbps if reads else a.write_gbps) * 1e3  # bytes/us
            up = a.uplink_gbps * 1e3
            t = a.t0 + trips * a.delta + max(per_gpu * m / bw, uplink * m / up)
            row.append((t, name))
        best = min(row)[1]
        cells = " | ".join(f"{t:.1f}" for t, _ in row)
        label = "42 KB (3 x 7168 bf16)" if m == 43008 else fmt_size(m)
        print(f"| {label} | {cells} | {best} |")


if __name__ == "__main__":
    main()
