"""A tensor-parallel decode step, as serving engines run it, with each
allreduce backend: step latency, tokens/s, and what the allreduces cost.

Each rank holds its shard of dense decoder layers (bf16, random weights made
on the GPU) and runs, per layer, what SGLang and vLLM run under tensor
parallelism:

    q, k, v = x @ W_qkv                  column-parallel (this rank's heads)
    write k, v into the KV cache; attend (grouped-query, --kv-len positions)
    o = attn @ W_o                        row-parallel: a partial sum
    allreduce(o); residual += o; x = rmsnorm(residual)
    g, u = x @ W_gate_up                  column-parallel
    d = (silu(g) * u) @ W_down            row-parallel: a partial sum
    allreduce(d); residual += d; x = rmsnorm(residual)   (next layer's input norm)

so each layer makes two allreduces of tokens x hidden (a 61-layer model makes
122 per step). The whole step is captured in one CUDA graph per backend and
token count, then replayed; the figure is the median replay time between two
CUDA events. Backends, in the same processes, same graph structure:

    nccl        torch.distributed.all_reduce (NCCL), in place
    ours        p2p_allreduce.CustomAllreduce.allreduce, captured zero-copy,
                then torch's add and rms_norm
    ours-fused  CustomAllreduce.allreduce_add_rmsnorm in place of the
                allreduce and the add + norm after it
    best-of-both  the drop-ins' routing: ours where CustomAllreduce.should_use
                says yes, NCCL where the machine's table (p2p-allreduce tune)
                measured NCCL faster for the size (as the engines' own NCCL
                path would take it); the row says which ran
    symm-mem    torch symmetric memory (one-shot up to 512 KiB, two-shot above)
    none        the same step with the allreduces left out: the compute floor

Checks (every one runs; after the table, which marks the rows that failed
and lists each failure, any failure makes the run exit 1): after a replayed
step every rank holds the same hidden state and residual bit for bit, for
every backend with allreduces (`none`'s ranks hold their own partial sums);
every call of `ours` and `ours-fused` in the step gives the same bits eager
as replayed in the graph: a second graph of the step copies each call's
inputs and outputs, and after its replay each call is made again eagerly on
those inputs; `ours-fused`'s residual equals `ours` followed by torch's add
on the step's shapes (docs/numerics.md). Reported, not required: how far
each backend's final hidden state is from `ours`, in ulps, and how many
elements of the whole step differ eager against replayed (torch's kernels
decide that: with two processes on one GPU even `none`, the control, does).

    python python/bench/bench_tp.py --gpus 0,1 --model deepseek-v3-dense
    python python/bench/bench_tp.py --gpus 0,0 --model llama-70b --layers 20   # two ranks on GPU 0
    python python/bench/bench_tp.py --gpus 0,1 --pattern verify            # 122 x (3 x 7168) allreduces, no compute

Ranks that share a GPU (`--gpus 0,0`) time-slice it: the harness and the
checks run, `nccl` and `symm-mem` are skipped with the reason (NCCL refuses
two ranks on one GPU), and the timings measure the sharing, not a decode
step. What is not modelled: MoE layers, multi-head latent attention, rotary
embeddings, paged KV caches and engine attention kernels (attention is
torch's scaled_dot_product_attention), the vocabulary-parallel embedding and
LM head, and sampling.
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time
import traceback

from tp_backends import (ATTENTION, EPS, SYMM_ONE_SHOT_MAX, Failed, Model, Record, all_agree, capture,
                         differing_bits, fused_op_check, same_ranks, time_replays)
from tp_report import gains, svg_plot, table, ulps_bf16
from tp_shapes import PRESETS, Shape, model_shape  # noqa: F401 (Shape: the tests use bench_tp.Shape)

BACKENDS = ["nccl", "ours", "ours-fused", "best-of-both", "symm-mem", "none"]
#: Backends that run our group (and so need CustomAllreduce and its capture()).
OUR_BACKENDS = ("ours", "ours-fused", "best-of-both")
TOKENS = [1, 3, 8, 32, 128]
DEFAULT_ATTENTION = "auto"


# ---- the ranks ---------------------------------------------------------------


def worker(rank, world, gpus, port, args):
    try:
        _worker(rank, world, gpus, port, args)
    except Failed as e:
        print(f"bench_tp: rank {rank}: CHECK FAILED: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


def _worker(rank, world, gpus, port, args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import p2p_allreduce as pa

    dev = torch.device("cuda", gpus[rank])
    torch.cuda.set_device(dev)
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    shared_gpu = len(set(gpus)) < len(gpus)
    # gloo carries the harness's own exchanges (and, on a shared GPU, every
    # group); NCCL the `nccl` backend where each rank has its own GPU.
    backend = "gloo" if shared_gpu else "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.group.WORLD
    shape, changed = model_shape(args, world)
    tokens = sorted(set(args.tokens))
    seqs = max(tokens)

    def log(*a):
        if rank == 0:
            print(*a, flush=True)

    def agree(flag):
        """True only where every rank says True (over gloo: also a barrier)."""
        return all_agree(torch, dist, group, flag)

    # Which backends can run here, and why not where not.
    skip = {}
    if shared_gpu:
        for b in ("nccl", "symm-mem", "best-of-both"):
            skip[b] = f"ranks share a GPU ({args.gpus}): NCCL refuses two ranks on one device"
    symm = None
    if "symm-mem" in args.backends and "symm-mem" not in skip:
        try:
            import torch.distributed._symmetric_memory as symm_mem

            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(group.group_name)
            symm = symm_mem
        except Exception as e:  # noqa: BLE001
            skip["symm-mem"] = f"torch symmetric memory unavailable: {type(e).__name__}: {e}"
    ca = None
    if any(b in args.backends for b in OUR_BACKENDS):
        max_bytes = max(shape.allreduce_bytes(t) for t in tokens)
        # Fastest mode (best-of-both routes by the table); `ours` and
        # `ours-fused` call the kernels directly either way.
        ca = pa.CustomAllreduce(group, dev, max_size=max(max_bytes, 64 << 10), timeout=args.timeout,
                                deterministic=False)
        if "best-of-both" in args.backends and rank == 0:
            print("bench_tp: best-of-both routes by " + ("a tuned table" if ca._group().tuned else
                  "the built-in table (every size ours: run `p2p-allreduce tune` to measure NCCL)")
                  + f": {ca.nccl_bands}", flush=True)

    if args.pattern == "verify":
        rows = verify_pattern(torch, dist, group, rank, dev, shape, tokens, args, ca, symm, skip, log)
        finish(rank, rows, shape, changed, args, gpus, torch, log)
        if ca is not None:
            ca.check()
            ca.close()
        dist.destroy_process_group()
        return

    # Memory: weights and KV caches of every layer, per rank; ranks that
    # share a GPU share its memory. Nothing is scaled down silently.
    free, total = torch.cuda.mem_get_info(dev)
    per_gpu = gpus.count(gpus[rank])
    need = shape.bytes_per_rank(seqs, args.kv_len)
    budget = 0.85 * total / per_gpu
    if not agree(need <= budget):
        fit = shape.max_layers(seqs, args.kv_len, budget)
        if rank == 0:
            print(f"bench_tp: {args.model or 'the model'} at TP {world} needs {need / 2**30:.1f} GiB per rank "
                  f"({shape.layers} layers, {seqs} sequences x {args.kv_len} KV positions), and {per_gpu} rank(s) "
                  f"share each {total / 2**30:.0f} GiB GPU here: pass --layers {fit} or fewer "
                  f"(or fewer --tokens / a shorter --kv-len)", file=sys.stderr, flush=True)
        sys.exit(2)

    model = Model(torch, shape, seqs, args.kv_len, dev, seed=args.seed, rank=rank)
    log(f"bench_tp: {args.model or 'custom'}: {shape.describe()}"
        + (f"; changed from the preset: {', '.join(changed)}" if changed else "")
        + f"; KV length {args.kv_len}; attention {args.attention}; {need / 2**30:.1f} GiB per rank; GPUs {gpus}; torch {torch.__version__}")
    if args.model and shape.layers != PRESETS[args.model]["layers"]:
        log(f"bench_tp: NOTE: {shape.layers} of the model's {PRESETS[args.model]['layers']} layers run; "
            f"every figure below is for {shape.layers} layers ({2 * shape.layers} allreduces per step), not scaled up")
    for b, why in skip.items():
        if b in args.backends:
            log(f"bench_tp: {b}: skipped: {why}")

    rows = []
    finals = {}
    # Checks that fail are collected and the run goes on, so that one run
    # reports every token count and backend; it then fails (exit status 1).
    failures = []

    def checked(row, fn, *a):
        try:
            fn(*a)
        except Failed as e:
            failures.append(str(e))
            if row is not None:
                row["checks"] = "FAILED"

    # One stream for every eager step and capture (see the eager step).
    run_stream = torch.cuda.Stream(dev)
    for t in tokens:
        # The same replicated input on every rank (the embedding's output).
        g = torch.Generator(device=dev).manual_seed(args.seed + 1000 + t)
        res0 = torch.randn(t, shape.hidden, generator=g, device=dev).to(torch.bfloat16)
        if ca is not None and "ours-fused" in args.backends:
            checked(None, fused_op_check, torch, dist, group, ca, shape, t, dev, rank, args)
        differs = []
        for b in args.backends:
            row = {"tokens": t, "backend": b, "bytes": shape.allreduce_bytes(t), "allreduces": 2 * shape.layers}
            if b in skip:
                row["skipped"] = skip[b]
                rows.append(row)
                continue
            step = model.step_fn(b, t, ca=ca, group=group, symm=symm, dist=dist, F=F,
                                 attention_backend=args.attention)
            state = model.state(t)
            # Eager first (warms up every kernel, and is the reference for
            # the replayed bits of our backends), on the stream the graph is
            # then captured on: cuBLAS may pick other kernels on another
            # stream, and the eager bits would then differ for torch's
            # reasons, not ours.
            state.reset(res0)
            run_stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(run_stream):
                step()
            torch.cuda.synchronize(dev)
            eager = state.snapshot()
            graph = capture(torch, dev, step, ca if b in OUR_BACKENDS else None, run_stream)
            state.reset(res0)
            graph.replay()
            torch.cuda.synchronize(dev)
            replayed = state.snapshot()
            if ca is not None:
                ca.check()
            # Tests of this harness: one flipped bit on the last rank (in the
            # replayed step, and in its first recorded call below) must fail
            # the run.
            inject = args.inject_fault and rank == world - 1 and b == args.backends[0]
            if inject:
                replayed[0].view(torch.int16).view(-1)[0] ^= 1
            # Bits that must agree: across ranks (not for `none`, whose
            # ranks never sum their partials), and each call of ours eager
            # against replayed on the same inputs (a recorded replay).
            row["checks"] = "passed"
            if b == "best-of-both":
                row["ran"] = ca.choose(torch.empty(t, shape.hidden, dtype=torch.bfloat16, device=dev))
            if b != "none":
                checked(row, same_ranks, torch, dist, group, replayed,
                        f"{b}, {t} tokens: the replayed step's hidden state")
            if b in ("ours", "ours-fused"):
                rec = Record(torch, 2 * shape.layers, t, shape.hidden, dev, fused=b == "ours-fused")
                rstep = model.step_fn(b, t, ca=ca, group=group, symm=symm, dist=dist, F=F,
                                      attention_backend=args.attention, record=rec)
                rgraph = capture(torch, dev, rstep, ca, run_stream)
                state.reset(res0)
                rgraph.replay()
                torch.cuda.synchronize(dev)
                del rgraph
                if inject:
                    rec.out[0].view(torch.int16).view(-1)[0] ^= 1
                bad = rec.mismatches(ca)
                row["calls_checked"] = rec.next
                if bad:
                    row["checks"] = "FAILED"
                    failures.append(f"rank {rank}, {b}, {t} tokens: {len(bad)} of the step's {rec.next} calls of ours "
                                    f"gave other bits eager than replayed, on the same inputs (call {bad[0][0]}: "
                                    f"{bad[0][1]} elements)")
                del rec
            # Reported, not required: the whole step eager against replayed
            # (torch's own kernels decide it; `none` is the control).
            if b in ("ours", "ours-fused", "none"):
                n_diff = 0
                for name, a_, b_ in zip(("hidden", "residual"), eager, replayed):
                    bad = differing_bits(torch, a_, b_)
                    n_diff += bad
                    if bad:
                        differs.append(f"{b}: {name} in {bad} of {a_.numel()} elements")
                row["step_eager_vs_replayed_differ"] = n_diff
            finals[(t, b)] = replayed[0]
            times = time_replays(torch, dist, group, graph, args)
            if ca is not None:
                ca.check()
            row["step_us"] = round(statistics.median(times), 1)
            row["min_us"] = round(min(times), 1)
            del graph
            rows.append(row)
            log(f"  tokens {t:4d}  {b:10s}  {row['step_us']:10.1f} us")
        if differs:
            print(f"bench_tp: rank {rank}, {t} tokens: NOTE: the whole step eager and replayed differ (reported, not "
                  f"a check: torch's kernels decide it, `none` is the control): {'; '.join(differs)}", flush=True)
        # Not required to agree: the distance from `ours`, in ulps.
        ref = finals.get((t, "ours"))
        for row in rows:
            if row["tokens"] == t and ref is not None and (t, row["backend"]) in finals and row["backend"] != "none":
                d = ulps_bf16(finals[(t, row["backend"])].view(torch.int16), ref.view(torch.int16))
                row["max_ulps_vs_ours"] = int(d.max().item())
                row["mean_ulps_vs_ours"] = round(d.float().mean().item(), 3)
    # Every rank's failures (eager against replayed is judged per rank),
    # reported by rank 0 beside the table; any fails the run on every rank.
    everyone = [None] * world
    dist.all_gather_object(everyone, (failures, [(r["tokens"], r["backend"], r.get("checks")) for r in rows]),
                           group=group)
    failed_rows = {(t, b) for _, marks in everyone for t, b, c in marks if c == "FAILED"}
    for r in rows:
        if (r["tokens"], r["backend"]) in failed_rows:
            r["checks"] = "FAILED"
    # Cross-rank checks fail alike on every rank: each failure once, in order.
    seen = list(dict.fromkeys(f for fs, _ in everyone for f in fs))
    finish(rank, rows, shape, changed, args, gpus, torch, log, seen)
    if ca is not None:
        ca.check()
        ca.close()
    dist.destroy_process_group()
    if seen:
        raise Failed(f"{len(seen)} check(s) failed (listed above)")


def verify_pattern(torch, dist, group, rank, dev, shape, tokens, args, ca, symm, skip, log):
    """2 x layers allreduces of tokens x hidden bf16 back to back in one
    graph, no compute: the communication of one step (default: the
    speculative verify of 3 tokens on deepseek-v3-dense, 122 x 42 KB)."""
    import torch.nn.functional as F

    rows = []
    n_ar = 2 * shape.layers
    log(f"bench_tp: verify pattern: {n_ar} allreduces per step, hidden {shape.hidden}, bf16, GPUs {args.gpus}")
    for b, why in skip.items():
        if b in args.backends:
            log(f"bench_tp: {b}: skipped: {why}")
    for t in tokens:
        nbytes = shape.allreduce_bytes(t)
        for b in args.backends:
            row = {"tokens": t, "backend": b, "bytes": nbytes, "allreduces": n_ar}
            if b == "none":
                row["skipped"] = "no compute in this pattern: nothing to time"
                rows.append(row)
                continue
            if b in skip:
                row["skipped"] = skip[b]
                rows.append(row)
                continue
            g = torch.Generator(device=dev).manual_seed(args.seed + rank * 13 + t)
            if b == "symm-mem":
                x = symm.empty(t, shape.hidden, dtype=torch.bfloat16, device=dev)
                symm.rendezvous(x, group.group_name)
            else:
                x = torch.empty(t, shape.hidden, dtype=torch.bfloat16, device=dev)
            x.copy_(torch.randn(t, shape.hidden, generator=g, device=dev).to(torch.bfloat16))
            out = torch.empty_like(x)
            res = torch.zeros_like(x)
            w = torch.ones(shape.hidden, dtype=torch.bfloat16, device=dev)

            def body():
                for _ in range(n_ar):
                    if b == "nccl":
                        dist.all_reduce(x, group=group)
                    elif b == "ours" or (b == "best-of-both" and ca.should_use(x)):
                        ca.allreduce(x, out=out)
                    elif b == "best-of-both":
                        dist.all_reduce(x, group=group)
                    elif b == "ours-fused":
                        ca.allreduce_add_rmsnorm(x, res, w, EPS, out=out)
                    elif nbytes <= SYMM_ONE_SHOT_MAX:
                        torch.ops.symm_mem.one_shot_all_reduce(x, "sum", group.group_name)
                    else:
                        torch.ops.symm_mem.two_shot_all_reduce_(x, "sum", group.group_name)

            body()
            torch.cuda.synchronize(dev)
            graph = capture(torch, dev, body, ca if b in OUR_BACKENDS else None)
            times = time_replays(torch, dist, group, graph, args)
            if ca is not None:
                ca.check()
            row["step_us"] = round(statistics.median(times), 1)
            row["per_allreduce_us"] = round(row["step_us"] / n_ar, 2)
            if b == "ours-fused":
                row["note"] = "allreduce + residual add + RMSNorm per call"
            del graph
            rows.append(row)
            log(f"  tokens {t:4d}  {b:10s}  {row['step_us']:10.1f} us  ({row['per_allreduce_us']:.2f} us each)")
    _ = F
    return rows


def finish(rank, rows, shape, changed, args, gpus, torch, log, failures=()):
    """Rank 0 prints the table (and the failed checks, if any) and writes
    the JSON and SVG."""
    if rank != 0:
        return
    gains(rows)
    title = (f"{args.model or 'custom'} TP {len(gpus)} on GPUs {args.gpus}"
             + (f", {shape.layers} layers" if args.model and shape.layers != PRESETS[args.model]["layers"] else ""))
    print(f"\n{title}: {args.pattern}, median of {args.reps} graph replays, bf16, KV length {args.kv_len}, attention {args.attention}")
    print(table(rows, args.pattern), flush=True)
    if args.pattern == "step":
        if failures:
            print(f"\nCHECKS FAILED ({len(failures)}):", flush=True)
            for f in failures:
                print(f"  - {f}", flush=True)
        else:
            print("\nchecks: every check passed (ranks agree bit for bit; every call of ours and ours-fused gives "
                  "the same bits eager as replayed, on the same inputs; fused residual = allreduce + add)", flush=True)
    meta = {
        "model": args.model, "shape": vars(shape), "changed_from_preset": changed, "pattern": args.pattern,
        "gpus": gpus, "kv_len": args.kv_len, "attention": args.attention, "reps": args.reps, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"), "rows": rows,
        "shared_gpu": len(set(gpus)) < len(gpus), "failed_checks": list(failures),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)
    if args.svg and args.pattern == "step":
        svg_plot(rows, title, args.svg)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="0,1", help="comma-separated CUDA devices, one rank each (0,0: two ranks on GPU 0)")
    p.add_argument("--model", choices=sorted(PRESETS), default="deepseek-v3-dense",
                   help="model shape preset (the flags below override it)")
    for k in ("hidden", "layers", "intermediate", "heads", "kv-heads", "head-dim"):
        p.add_argument(f"--{k}", type=int, help=f"override the preset's {k}")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)),
                   help="tokens per step (rows of each allreduce), comma-separated")
    p.add_argument("--kv-len", type=int, default=1024, help="KV-cache positions each token attends to")
    p.add_argument("--attention", choices=sorted(ATTENTION), default=DEFAULT_ATTENTION,
                   help="torch's scaled_dot_product_attention backend (auto: torch picks per call)")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated, of " + ", ".join(BACKENDS))
    p.add_argument("--pattern", choices=["step", "verify"], default="step",
                   help="step: the decode step; verify: only its allreduces (default tokens 3)")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True) in every rank (for trying whether torch's own "
                        "kernels then give the same bits eager and replayed; the checks do not need it)")
    p.add_argument("--reps", type=int, default=20, help="timed graph replays (the median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed replays first")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds our kernels wait for a peer")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--inject-fault", action="store_true",
                   help="for tests of the harness: flip one bit of the last rank's hidden state (the run must fail)")
    p.add_argument("--json", help="write rank 0's rows here")
    p.add_argument("--svg", help="write the step-latency plot here (pattern step)")
    args = p.parse_args(argv)
    args.gpus_list = [int(g) for g in args.gpus.split(",")]
    if len(args.gpus_list) < 2:
        p.error("--gpus needs at least two ranks (e.g. 0,1, or 0,0 for two ranks on GPU 0)")
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in args.backends if b not in BACKENDS]
    if bad:
        p.error(f"unknown backend(s) {bad}: choose from {BACKENDS}")
    if args.pattern == "verify" and args.tokens == ",".join(map(str, TOKENS)):
        args.tokens = "3"
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens must be comma-separated integers, got {args.tokens!r}")
    if any(t < 1 for t in args.tokens):
        p.error("--tokens must be positive")
    if args.kv_len < 1 or args.reps < 1 or args.warmup < 0:
        p.error("--kv-len and --reps must be positive, --warmup not negative")
    try:
        model_shape(args, len(args.gpus_list))
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None):
    args = parse_args(argv)
    # cuBLAS gives the same bits run to run only with a fixed workspace per
    # stream (its reproducibility notes): the eager-vs-replayed checks need it.
    for k, v in [("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"),
                 ("CUBLAS_WORKSPACE_CONFIG", ":4096:8")]:
        os.environ.setdefault(k, v)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(worker, args=(len(args.gpus_list), args.gpus_list, port, args),
                           nprocs=len(args.gpus_list), start_method="spawn")
    except mp.ProcessExitedException as e:
        print(f"bench_tp: a rank failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.exit(130)
