"""Allreduce through torch, one process per GPU, all in one run: ours
(p2p_allreduce.CustomAllreduce, zero-copy capture and staged) vs
torch.distributed.all_reduce (NCCL) vs torch symmetric memory
(one_shot_all_reduce, two_shot_all_reduce_), bf16, 4 KiB to 64 MiB.

Method (the same as `p2p-allreduce bench`): for each size and method, a
CUDA graph holding K back-to-back allreduces of one buffer is replayed 3
times untimed, then R times, each between two CUDA events; the figure is
the median replay time / K, in microseconds. The host's launch latency
falls inside each replay's events, so K (--per-graph, default 50) is kept
large enough to spread it thin; compare with the Rust bench run with the
same --per-graph.
Rank 0 prints a markdown table and, with --json PATH, writes the figures.

    python python/bench/bench_torch.py --gpus 0,1 [--json out.json]
    python python/bench/bench_torch.py --gpus 0,1 --fused   # rows x 7168: fused vs unfused

On multi-GPU NVLink machines keep NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 set (this script sets them if unset).
"""

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import traceback

SIZES = [4 << 10, 16 << 10, 42 * 1024, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
METHODS = ["ours (graph, zero-copy)", "ours (graph, staged)", "NCCL all_reduce", "symm_mem one_shot", "symm_mem two_shot"]


def timed(torch, dev, body, k, reps, around=None):
    """Median microseconds per op of a graph of `k` calls of body().
    `around`: a context manager held while capturing (ours: ca.capture(),
    which registers the captured buffers on exit, before any replay)."""
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        body()  # warm-up outside capture
    torch.cuda.current_stream(dev).wait_stream(s)
    torch.cuda.synchronize(dev)
    g = torch.cuda.CUDAGraph()
    with around if around is not None else contextlib.nullcontext():
        with torch.cuda.graph(g):
            for _ in range(k):
                body()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / k)
    del g
    return statistics.median(times)


def worker(rank, world, gpus, port, args):
    import torch
    import torch.distributed as dist

    import p2p_allreduce as pa

    dev = torch.device("cuda", gpus[rank])
    torch.cuda.set_device(dev)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=dev
    )
    group = dist.group.WORLD
    ca = pa.CustomAllreduce(group, dev, max_size=max(SIZES))
    symm = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group.group_name)
        symm = symm_mem
    except Exception as e:  # noqa: BLE001
        symm_why = f"import: {e}"
    rows = []
    for size in SIZES:
        n = size // 2
        x = torch.randn(n, device=dev).to(torch.bfloat16)
        out = torch.empty_like(x)
        row = {"bytes": size}
        k, reps = args.per_graph, args.reps

        def ours_zero_copy():
            return timed(torch, dev, lambda: ca.allreduce(x, out=out), k, reps, around=ca.capture())

        def ours_staged():
            return timed(torch, dev, lambda: ca.allreduce(x, out=out), k, reps, around=ca.capture(zero_copy=False))

        def nccl():
            return timed(torch, dev, lambda: dist.all_reduce(x, group=group), k, reps)

        def symm_one():
            t = symm.empty(n, dtype=torch.bfloat16, device=dev)
            t.copy_(x)
            symm.rendezvous(t, group.group_name)
            return timed(torch, dev, lambda: torch.ops.symm_mem.one_shot_all_reduce(t, "sum", group.group_name), k, reps)

        def symm_two():
            t = symm.empty(n, dtype=torch.bfloat16, device=dev)
            t.copy_(x)
            symm.rendezvous(t, group.group_name)
            return timed(torch, dev, lambda: torch.ops.symm_mem.two_shot_all_reduce_(t, "sum", group.group_name), k, reps)

        for name, fn in zip(METHODS, [ours_zero_copy, ours_staged, nccl, symm_one, symm_two]):
            if name.startswith("symm") and symm is None:
                row[name] = f"n/a ({symm_why})"
                continue
            try:
                row[name] = round(fn(), 2)
            except Exception as e:  # noqa: BLE001
                row[name] = f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
                if rank == 0:
                    traceback.print_exc()
            dist.barrier()
        row["algorithm"] = ca.choose(x)
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    ca.check()
    if rank == 0:
        head = "| size | " + " | ".join(METHODS) + " | our algorithm |"
        print(head)
        print("|" + "---|" * (len(METHODS) + 2))
        print(f"per-graph {args.per_graph}, replays {args.reps}, torch {torch.__version__}")
        for r in rows:
            b = r["bytes"]
            label = f"{b >> 20} MiB" if b >= 1 << 20 else f"{b / 1024:g} KiB"
            cells = [f"{r[m]} us" if isinstance(r[m], float) else str(r[m]) for m in METHODS]
            print(f"| {label} | " + " | ".join(cells) + f" | {r['algorithm']} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"gpus": gpus, "torch": torch.__version__, "rows": rows}, f, indent=1)
    dist.barrier()
    ca.close()
    dist.destroy_process_group()


FUSED_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 512]
FUSED_METHODS = [
    "ours fused (zero-copy)",
    "ours allreduce (zero-copy)",
    "ours allreduce + torch add, rms_norm",
    "NCCL all_reduce + torch add, rms_norm",
]


def fused_worker(rank, world, gpus, port, args):
    """Rows x hidden bf16: the fused call vs the plain allreduce of the same
    bytes vs the unfused sequences an engine runs without it."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import p2p_allreduce as pa

    dev = torch.device("cuda", gpus[rank])
    torch.cuda.set_device(dev)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=dev
    )
    group = dist.group.WORLD
    hidden = args.hidden
    ca = pa.CustomAllreduce(group, dev, max_size=max(FUSED_ROWS) * hidden * 2)
    eps = 1e-6
    w = torch.randn(hidden, device=dev).to(torch.bfloat16)
    rows_out = []
    for rows in FUSED_ROWS:
        x = torch.randn(rows, hidden, device=dev).to(torch.bfloat16) * 0.01
        res = torch.randn(rows, hidden, device=dev).to(torch.bfloat16)
        out = torch.empty_like(x)
        tmp = torch.empty_like(x)
        k, reps = args.per_graph, args.reps
        row = {"rows": rows, "hidden": hidden}

        def unfused_ours():
            ca.allreduce(x, out=tmp)
            res.add_(tmp)
            return F.rms_norm(res, (hidden,), w, eps)

        def unfused_nccl():
            dist.all_reduce(x, group=group)
            res.add_(x)
            return F.rms_norm(res, (hidden,), w, eps)

        bodies = [
            (lambda: ca.allreduce_add_rmsnorm(x, res, w, eps, out=out), ca.capture()),
            (lambda: ca.allreduce(x, out=out), ca.capture()),
            (unfused_ours, ca.capture()),
            (unfused_nccl, None),
        ]
        for name, (body, around) in zip(FUSED_METHODS, bodies):
            try:
                row[name] = round(timed(torch, dev, body, k, reps, around=around), 2)
            except Exception as e:  # noqa: BLE001
                row[name] = f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
                if rank == 0:
                    traceback.print_exc()
            dist.barrier()
        rows_out.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    ca.check()
    if rank == 0:
        print(f"per-graph {args.per_graph}, replays {args.reps}, torch {torch.__version__}, bf16, hidden {hidden}")
        print("| rows | " + " | ".join(FUSED_METHODS) + " |")
        print("|" + "---|" * (len(FUSED_METHODS) + 1))
        for r in rows_out:
            cells = [f"{r[m]} us" if isinstance(r[m], float) else str(r[m]) for m in FUSED_METHODS]
            print(f"| {r['rows']} | " + " | ".join(cells) + " |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"gpus": gpus, "torch": torch.__version__, "rows": rows_out}, f, indent=1)
    dist.barrier()
    ca.close()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="0,1", help="comma-separated CUDA devices, one process each")
    p.add_argument("--json", help="write rank 0's figures here")
    p.add_argument("--per-graph", type=int, default=50, help="allreduces captured back to back in each graph (K)")
    p.add_argument("--reps", type=int, default=30, help="timed replays per row (R); the median is reported")
    p.add_argument("--fused", action="store_true", help="rows x --hidden: the fused allreduce + add + RMSNorm instead")
    p.add_argument("--hidden", type=int, default=7168, help="row length for --fused")
    args = p.parse_args()
    for k, v in [("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")]:
        os.environ.setdefault(k, v)
    gpus = [int(g) for g in args.gpus.split(",")]
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fn = fused_worker if args.fused else worker
    mp.start_processes(fn, args=(len(gpus), gpus, port, args), nprocs=len(gpus), start_method="spawn")


if __name__ == "__main__":
    sys.exit(main())
