#!/usr/bin/env python3
"""Baselines for docs/benchmarks.md, timed the way `p2p-allreduce bench` times
ours: one process per GPU, bf16, a CUDA graph of 20 allreduces replayed 25
times after 3 warm-ups, CUDA events around each replay, median per call.

Rows: NCCL through torch.distributed.all_reduce, and torch's symmetric-memory
one_shot_all_reduce / two_shot_all_reduce_. Needs torch with CUDA and two or
more GPUs. NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NCCL_NVLS_ENABLE=0), as on every shared multi-GPU host.

    python3 scripts/torch_baseline.py [--out rows.json] [--max-bytes 64M]
"""
import argparse
import json
import os
import statistics
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

PER_GRAPH, WARMUP, REPLAYS = 20, 3, 25


def sizes(max_bytes):
    b = 4096
    while b <= max_bytes:
        yield b
        b *= 2


def time_graph(torch, fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up outside capture (lazy setup)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(PER_GRAPH):
            fn()
    for _ in range(WARMUP):
        g.replay()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(REPLAYS):
        torch.distributed.barrier()
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / PER_GRAPH)
    return statistics.median(times)


def worker(rank, world, max_bytes, out, port):
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    rows = []
    symm = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm = symm_mem
    except Exception as e:  # noqa: BLE001
        if rank == 0:
            print(f"# symmetric memory unavailable: {e}")
    for size in sizes(max_bytes):
        n = size // 2
        x = torch.randn(n, dtype=torch.bfloat16, device="cuda")
        row = {"size": size, "world": world}
        try:
            row["nccl_us"] = time_graph(torch, lambda: dist.all_reduce(x))
        except Exception as e:  # noqa: BLE001
            row["nccl_error"] = str(e)[:200]
        if symm is not None:
            try:
                t = symm.empty(n, dtype=torch.bfloat16, device="cuda")
                symm.rendezvous(t, group.group_name)
                t.copy_(x)
                row["symm_one_shot_us"] = time_graph(
                    torch, lambda: torch.ops.symm_mem.one_shot_all_reduce(t, "sum", group.group_name)
                )
                row["symm_two_shot_us"] = time_graph(
                    torch, lambda: torch.ops.symm_mem.two_shot_all_reduce_(t, "sum", group.group_name)
                )
            except Exception as e:  # noqa: BLE001
                row["symm_error"] = str(e)[:200]
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0 and out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--max-bytes", default=str(64 << 20))
    ap.add_argument("--port", type=int, default=29531)
    a = ap.parse_args()
    import torch
    import torch.multiprocessing as mp

    world = torch.cuda.device_count()
    if world < 2:
        print("torch_baseline: needs two or more GPUs", file=sys.stderr)
        return 2
    mb = a.max_bytes.upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(mb[-1], 1)
    max_bytes = int(mb.rstrip("KMG")) * mult
    print(f"# torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, world {world}, bf16, "
          f"graph of {PER_GRAPH} calls, median of {REPLAYS} replays")
    mp.spawn(worker, args=(world, max_bytes, a.out, a.port), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
