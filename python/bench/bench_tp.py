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
import math
import os
import socket
import statistics
import sys
import time
import traceback

#: Model shapes. deepseek-v3-dense: DeepSeek-V3's hidden size, depth and
#: dense-layer MLP width, with its attention modelled as grouped-query
#: attention of 56 x 128 heads (8 KV heads) instead of MLA, and every layer
#: dense instead of MoE.
PRESETS = {
    "deepseek-v3-dense": dict(hidden=7168, layers=61, intermediate=18432, heads=56, kv_heads=8, head_dim=128),
    "llama-70b": dict(hidden=8192, layers=80, intermediate=28672, heads=64, kv_heads=8, head_dim=128),
}
BACKENDS = ["nccl", "ours", "ours-fused", "best-of-both", "symm-mem", "none"]
#: Backends that run our group (and so need CustomAllreduce and its capture()).
OUR_BACKENDS = ("ours", "ours-fused", "best-of-both")
TOKENS = [1, 3, 8, 32, 128]
#: --attention: torch's SDPA backends by name (torch.nn.attention.SDPBackend).
ATTENTION = {"auto": None, "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH",
             "cudnn": "CUDNN_ATTENTION"}
DEFAULT_ATTENTION = "auto"
#: symm-mem runs one-shot up to this many bytes, two-shot above.
SYMM_ONE_SHOT_MAX = 512 << 10
EPS = 1e-6


class Shape:
    """One rank's shard of the model at tensor-parallel size `tp`."""

    def __init__(self, hidden, layers, intermediate, heads, kv_heads, head_dim, tp):
        for name, v in [("hidden", hidden), ("layers", layers), ("intermediate", intermediate), ("heads", heads),
                        ("kv_heads", kv_heads), ("head_dim", head_dim), ("tp", tp)]:
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if heads % tp:
            raise ValueError(f"{heads} attention heads do not split over TP {tp}: pick a TP that divides them")
        if intermediate % tp:
            raise ValueError(f"intermediate size {intermediate} does not split over TP {tp}")
        if heads % kv_heads:
            raise ValueError(f"{heads} heads are not a multiple of {kv_heads} KV heads (grouped-query attention)")
        if kv_heads % tp and tp % kv_heads:
            raise ValueError(f"{kv_heads} KV heads neither split over nor replicate across TP {tp}")
        self.hidden, self.layers, self.intermediate = hidden, layers, intermediate
        self.heads, self.kv_heads, self.head_dim, self.tp = heads, kv_heads, head_dim, tp
        self.q_heads = heads // tp
        # As engines do: KV heads split over the ranks, or replicated when
        # there are fewer KV heads than ranks.
        self.kv_local = max(kv_heads // tp, 1)
        self.inter_local = intermediate // tp

    def layer_weight_elems(self):
        d, h = self.head_dim, self.hidden
        qkv = h * (self.q_heads + 2 * self.kv_local) * d
        o = self.q_heads * d * h
        gate_up = h * 2 * self.inter_local
        down = self.inter_local * h
        return qkv + o + gate_up + down + 2 * h  # + the two norm weights

    def kv_elems(self, seqs, kv_len):
        """K and V caches of one layer for `seqs` sequences."""
        return 2 * seqs * self.kv_local * kv_len * self.head_dim

    def bytes_per_rank(self, seqs, kv_len):
        """Weights and KV caches of every layer, bf16 (activations and
        graph pools are small beside them)."""
        return 2 * self.layers * (self.layer_weight_elems() + self.kv_elems(seqs, kv_len))

    def max_layers(self, seqs, kv_len, budget_bytes):
        per_layer = 2 * (self.layer_weight_elems() + self.kv_elems(seqs, kv_len))
        return int(budget_bytes // per_layer)

    def allreduce_bytes(self, tokens):
        return tokens * self.hidden * 2

    def describe(self):
        return (f"hidden {self.hidden}, {self.layers} layers, intermediate {self.intermediate}, "
                f"{self.heads} heads / {self.kv_heads} KV heads x {self.head_dim}, TP {self.tp} "
                f"({self.q_heads} q heads, {self.kv_local} KV heads, {self.inter_local} MLP columns per rank)")


def model_shape(args, tp):
    """The preset with any --hidden/--layers/... overrides; says what changed."""
    base = dict(PRESETS[args.model]) if args.model else {}
    changed = []
    for k in ("hidden", "layers", "intermediate", "heads", "kv_heads", "head_dim"):
        v = getattr(args, k)
        if v is not None:
            if k in base and base[k] != v:
                changed.append(f"{k} {v} (preset {base[k]})")
            base[k] = v
    missing = [k for k in ("hidden", "layers", "intermediate", "heads", "kv_heads", "head_dim") if k not in base]
    if missing:
        raise ValueError("no --model given: set " + ", ".join("--" + m.replace("_", "-") for m in missing))
    return Shape(tp=tp, **base), changed


def ulps_bf16(a_bits, b_bits):
    """Per-element distance in bf16 ulps between two int16 bit tensors (the
    same value of either sign of zero is 0 apart; NaNs are reported apart)."""
    import torch

    def ordered(b):
        x = b.to(torch.int32) & 0xFFFF
        return torch.where(x >= 0x8000, 0x8000 - x, x)

    return (ordered(a_bits) - ordered(b_bits)).abs()


# ---- reporting (no torch needed) ---------------------------------------------


def gains(rows):
    """Adds the allreduce share (step minus `none`) and the gain over NCCL
    to each timed row, from the rows of the same token count."""
    by = {}
    for r in rows:
        by.setdefault(r["tokens"], {})[r["backend"]] = r
    for r in rows:
        same = by[r["tokens"]]
        us = r.get("step_us")
        none = same.get("none", {}).get("step_us")
        nccl = same.get("nccl", {}).get("step_us")
        if isinstance(us, float):
            r["tokens_per_s"] = round(r["tokens"] * 1e6 / us, 1)
            if isinstance(none, float) and r["backend"] != "none":
                r["allreduce_us"] = round(us - none, 1)
                r["allreduce_share"] = round((us - none) / us, 3)
            if isinstance(nccl, float):
                r["gain_over_nccl"] = round(nccl / us, 3)
    return rows


def table(rows, pattern):
    def cell(r, k, fmt):
        v = r.get(k)
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    if pattern == "verify":
        out = ["| tokens | bytes per allreduce | backend | allreduces | step us | us per allreduce | gain over NCCL |",
               "|---|---|---|---|---|---|---|"]
        for r in rows:
            us = r.get("step_us")
            per = cell(r, "per_allreduce_us", "{:.2f}")
            step = f"{us:.1f}" if isinstance(us, float) else str(r.get("skipped", "-"))
            out.append(f"| {r['tokens']} | {r['bytes']} | {r['backend']} | {r['allreduces']} | {step} | {per} | "
                       f"{cell(r, 'gain_over_nccl', '{:.2f}x')} |")
        return "\n".join(out)
    out = ["| tokens | backend | step us | tokens/s | allreduce us (step - none) | allreduce share | gain over NCCL | "
           "ulps from ours (max) | checks |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        us = r.get("step_us")
        step = f"{us:.1f}" if isinstance(us, float) else str(r.get("skipped", "-"))
        share = r.get("allreduce_share")
        out.append(
            f"| {r['tokens']} | {r['backend']} | {step} | {cell(r, 'tokens_per_s', '{:.1f}')} | "
            f"{cell(r, 'allreduce_us', '{:.1f}')} | {f'{100 * share:.1f}%' if isinstance(share, float) else '-'} | "
            f"{cell(r, 'gain_over_nccl', '{:.2f}x')} | {cell(r, 'max_ulps_vs_ours', '{}')} | {r.get('checks', '-')} |")
    return "\n".join(out)


def svg_plot(rows, title, path):
    """Step latency against tokens per step, one line per backend (log x),
    as a plain SVG file."""
    series = {}
    for r in rows:
        if isinstance(r.get("step_us"), float):
            series.setdefault(r["backend"], []).append((r["tokens"], r["step_us"] / 1000.0))
    W, H, L, R, T, B = 720, 440, 70, 150, 40, 50
    xs = sorted({t for pts in series.values() for t, _ in pts}) or [1]
    ymax = max([y for pts in series.values() for _, y in pts] or [1.0]) * 1.1
    lx0, lx1 = math.log2(xs[0]), math.log2(xs[-1]) if xs[-1] > xs[0] else math.log2(xs[0]) + 1

    def px(t):
        return L + (math.log2(t) - lx0) / (lx1 - lx0) * (W - L - R)

    def py(y):
        return H - B - y / ymax * (H - T - B)

    colours = {"nccl": "#d62728", "ours": "#1f77b4", "ours-fused": "#2ca02c", "best-of-both": "#ff7f0e",
               "symm-mem": "#9467bd", "none": "#7f7f7f"}
    e = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{_esc(title)}</text>',
         f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
         f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>',
         f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">tokens per step</text>',
         f'<text x="16" y="{(T + H - B) / 2}" text-anchor="middle" transform="rotate(-90 16 {(T + H - B) / 2})">'
         'step latency (ms)</text>']
    for t in xs:
        e.append(f'<text x="{px(t):.1f}" y="{H - B + 16}" text-anchor="middle">{t}</text>')
    for i in range(6):
        y = ymax * i / 5
        e.append(f'<text x="{L - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.2f}</text>')
        e.append(f'<line x1="{L}" y1="{py(y):.1f}" x2="{W - R}" y2="{py(y):.1f}" stroke="#ddd"/>')
    for i, (name, pts) in enumerate(sorted(series.items())):
        c = colours.get(name, "#000")
        pts = sorted(pts)
        e.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="'
                 + " ".join(f"{px(t):.1f},{py(y):.1f}" for t, y in pts) + '"/>')
        for t, y in pts:
            e.append(f'<circle cx="{px(t):.1f}" cy="{py(y):.1f}" r="3" fill="{c}"/>')
        e.append(f'<line x1="{W - R + 10}" y1="{T + 18 * i + 6}" x2="{W - R + 30}" y2="{T + 18 * i + 6}" '
                 f'stroke="{c}" stroke-width="2"/>')
        e.append(f'<text x="{W - R + 36}" y="{T + 18 * i + 10}">{_esc(name)}</text>')
    e.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(e) + "\n")


def _esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# ---- the ranks ---------------------------------------------------------------


class Failed(Exception):
    """A check where bits must agree did not."""


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


def time_replays(torch, dist, group, graph, args):
    """`args.warmup` untimed replays, then `args.reps` replays each between
    two CUDA events, every rank starting together (ranks that share a GPU
    too): the times in us."""
    for _ in range(args.warmup):
        graph.replay()
    times = []
    for _ in range(args.reps):
        all_agree(torch, dist, group, True)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1000.0)
    return times


def all_agree(torch, dist, group, flag):
    """True only where every rank says True: a CPU tensor, so gloo carries
    it (also a barrier between the ranks)."""
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def differing_bits(torch, a, b):
    """Elements of two bf16 tensors of one shape whose bits differ."""
    return int((a.view(torch.int16) != b.view(torch.int16)).sum().item())


def same_ranks(torch, dist, group, tensors, what):
    """Raises Failed unless every rank holds these tensors bit for bit."""
    world = dist.get_world_size(group)
    for i, t in enumerate(tensors):
        # As int32 (gloo has no 16-bit integers); the bits are unchanged.
        mine = t.detach().contiguous().view(torch.int16).cpu().to(torch.int32)
        got = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(got, mine, group=group)
        for r, other in enumerate(got):
            if not torch.equal(other, got[0]):
                bad = int((other != got[0]).sum().item())
                raise Failed(f"{what}: rank {r}'s tensor {i} differs from rank 0's in {bad} of {mine.numel()} elements")


def capture(torch, dev, body, ca, stream=None):
    """One CUDA graph of `body`, captured on `stream` (a new one if None);
    inside ca.capture() for our backends (it registers the captured buffers
    on exit, on every rank)."""
    import contextlib

    s = stream if stream is not None else torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    torch.cuda.synchronize(dev)
    g = torch.cuda.CUDAGraph()
    with ca.capture() if ca is not None else contextlib.nullcontext():
        with torch.cuda.graph(g, stream=s):
            body()
    torch.cuda.synchronize(dev)
    return g


def fused_op_check(torch, dist, group, ca, shape, t, dev, rank, args):
    """On the step's shape (t x hidden bf16), eager and in a graph: the fused
    call's residual equals our allreduce followed by torch's add, bit for
    bit; both are the same on every rank."""
    g = torch.Generator(device=dev).manual_seed(args.seed + 7 * rank + t)
    part = (torch.randn(t, shape.hidden, generator=g, device=dev) * 0.05).to(torch.bfloat16)
    g0 = torch.Generator(device=dev).manual_seed(args.seed + 99 + t)  # replicated
    res = torch.randn(t, shape.hidden, generator=g0, device=dev).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(shape.hidden, generator=g0, device=dev)).to(torch.bfloat16)
    summed = torch.full_like(part, float("nan"))
    r_unfused = res.clone()
    r_fused = res.clone()
    normed = torch.full_like(part, float("nan"))

    def body():
        ca.allreduce(part, out=summed)
        r_unfused.add_(summed)
        ca.allreduce_add_rmsnorm(part, r_fused, w, EPS, out=normed)

    for mode in ("eager", "graph"):
        r_unfused.copy_(res)
        r_fused.copy_(res)
        if mode == "eager":
            body()
        else:
            capture(torch, dev, body, ca).replay()
        torch.cuda.synchronize(dev)
        ca.check()
        bad = differing_bits(torch, r_unfused, r_fused)
        if bad:
            raise Failed(f"{t} tokens ({mode}): the fused residual differs from allreduce + torch add in {bad} elements")
        same_ranks(torch, dist, group, [r_fused, normed], f"{t} tokens ({mode}): the fused call's outputs")


class State:
    """The step's static buffers for one token count: the residual stream and
    the normed hidden state, read and written by every replay."""

    def __init__(self, torch, t, hidden, dev):
        self.torch = torch
        self.residual = torch.empty(t, hidden, dtype=torch.bfloat16, device=dev)
        self.hidden = torch.empty(t, hidden, dtype=torch.bfloat16, device=dev)
        self.start = torch.empty(t, hidden, dtype=torch.bfloat16, device=dev)

    def reset(self, res0):
        self.start.copy_(res0)
        self.residual.fill_(float("nan"))  # poison: the step must write both
        self.hidden.fill_(float("nan"))

    def snapshot(self):
        return self.hidden.clone(), self.residual.clone()


class Model:
    """One rank's shard: weights, KV caches and the step for a backend."""

    def __init__(self, torch, shape, seqs, kv_len, dev, seed, rank):
        self.torch, self.s, self.dev, self.kv_len = torch, shape, dev, kv_len
        g = torch.Generator(device=dev).manual_seed(seed * 1009 + rank)
        s = shape
        d, h = s.head_dim, s.hidden

        def w(out_f, in_f):
            # torch's Linear layout (out x in), scaled so activations stay O(1).
            x = torch.empty(out_f, in_f, dtype=torch.bfloat16, device=dev)
            x.normal_(0.0, 1.0 / math.sqrt(in_f), generator=g)
            return x

        self.layers = []
        for _ in range(s.layers):
            kv = torch.empty(2, seqs, s.kv_local, kv_len, d, dtype=torch.bfloat16, device=dev)
            kv.normal_(0.0, 1.0, generator=g)
            self.layers.append(dict(
                qkv=w((s.q_heads + 2 * s.kv_local) * d, h),
                o=w(h, s.q_heads * d),
                gate_up=w(2 * s.inter_local, h),
                down=w(h, s.inter_local),
                # Norm weights are replicated: the same on every rank.
                post_norm=torch.ones(h, dtype=torch.bfloat16, device=dev),
                next_norm=torch.ones(h, dtype=torch.bfloat16, device=dev),
                kv=kv,
            ))
        gn = torch.Generator(device=dev).manual_seed(seed * 31 + 5)
        for layer in self.layers:
            for k in ("post_norm", "next_norm"):
                layer[k].copy_((1 + 0.1 * torch.randn(h, generator=gn, device=dev)).to(torch.bfloat16))
        self.input_norm = torch.ones(h, dtype=torch.bfloat16, device=dev)
        self.states = {}

    def state(self, t):
        if t not in self.states:
            self.states[t] = State(self.torch, t, self.s.hidden, self.dev)
        return self.states[t]

    def step_fn(self, backend, t, ca, group, symm, dist, F, attention_backend="auto", record=None):
        """The step as a closure over static buffers (what a graph captures);
        attention on `attention_backend` (a key of ATTENTION). With a
        `Record`, every call of ours also copies its inputs and outputs
        there (a graph for the per-call check, not for timing)."""
        import contextlib

        torch, s = self.torch, self.s
        pinned = ATTENTION[attention_backend]
        if pinned is None:
            attention = contextlib.nullcontext
        else:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def attention():
                return sdpa_kernel([getattr(SDPBackend, pinned)])
        st = self.state(t)
        d, h = s.head_dim, s.hidden
        nbytes = t * h * 2
        # The row-parallel GEMMs write their partial sums here; symm-mem
        # needs it in symmetric memory (allocated and exchanged once).
        if backend == "symm-mem":
            part = symm.empty(t, h, dtype=torch.bfloat16, device=self.dev)
            symm.rendezvous(part, group.group_name)
        else:
            part = torch.empty(t, h, dtype=torch.bfloat16, device=self.dev)
        summed = torch.empty(t, h, dtype=torch.bfloat16, device=self.dev)
        gname = group.group_name

        def reduce_add_norm(weight):
            # part holds this rank's partial sum; leaves the new residual in
            # st.residual and the normed hidden state in st.hidden.
            if backend == "ours-fused":
                i = record.before(part, st.residual, weight) if record is not None else None
                ca.allreduce_add_rmsnorm(part, st.residual, weight, EPS, out=st.hidden)
                if record is not None:
                    record.after(i, st.hidden, st.residual)
                return
            if backend == "none":
                total = part
            elif backend == "nccl":
                dist.all_reduce(part, group=group)
                total = part
            elif backend == "ours" or (backend == "best-of-both" and ca.should_use(part)):
                i = record.before(part) if record is not None else None
                total = ca.allreduce(part, out=summed)
                if record is not None:
                    record.after(i, summed)
            elif backend == "best-of-both":
                dist.all_reduce(part, group=group)
                total = part
            elif backend == "symm-mem":
                if nbytes <= SYMM_ONE_SHOT_MAX:
                    total = torch.ops.symm_mem.one_shot_all_reduce(part, "sum", gname)
                else:
                    torch.ops.symm_mem.two_shot_all_reduce_(part, "sum", gname)
                    total = part
            else:
                raise ValueError(f"unknown backend {backend!r}")
            st.residual.add_(total)
            st.hidden.copy_(F.rms_norm(st.residual, (h,), weight, EPS))

        def step():
            if record is not None:
                record.next = 0
            st.residual.copy_(st.start)
            st.hidden.copy_(F.rms_norm(st.residual, (h,), self.input_norm, EPS))
            for layer in self.layers:
                qkv = F.linear(st.hidden, layer["qkv"])
                q, k, v = qkv.split([s.q_heads * d, s.kv_local * d, s.kv_local * d], dim=-1)
                kv = layer["kv"]
                # The new token's K and V at the cache's last position (the
                # same position every replay, so replays are idempotent).
                kv[0, :t, :, self.kv_len - 1, :].copy_(k.view(t, s.kv_local, d))
                kv[1, :t, :, self.kv_len - 1, :].copy_(v.view(t, s.kv_local, d))
                with attention():
                    a = F.scaled_dot_product_attention(
                        q.view(t, s.q_heads, 1, d), kv[0, :t], kv[1, :t], enable_gqa=s.q_heads != s.kv_local)
                torch.mm(a.reshape(t, s.q_heads * d), layer["o"].t(), out=part)
                reduce_add_norm(layer["post_norm"])
                gate, up = F.linear(st.hidden, layer["gate_up"]).chunk(2, dim=-1)
                torch.mm(F.silu(gate) * up, layer["down"].t(), out=part)
                reduce_add_norm(layer["next_norm"])

        return step


class Record:
    """Each call of ours in a recorded step: its inputs and outputs, copied
    inside the graph, so that the same call can be made again eagerly on
    the same inputs (`mismatches`). That checks our calls eager against
    replayed without depending on torch's compute giving the same bits
    both ways, which it does not when ranks share a GPU (docs/design.md)."""

    def __init__(self, torch, calls, t, hidden, dev, fused):
        self.torch, self.fused, self.next = torch, fused, 0
        def poisoned():
            return torch.full((calls, t, hidden), float("nan"), dtype=torch.bfloat16, device=dev)

        self.inp, self.out = poisoned(), poisoned()
        self.res_in, self.res_out = (poisoned(), poisoned()) if fused else (None, None)
        self.weights = [None] * calls

    def before(self, part, residual=None, weight=None):
        i = self.next
        self.next += 1
        self.inp[i].copy_(part)
        if self.fused:
            self.res_in[i].copy_(residual)
            self.weights[i] = weight
        return i

    def after(self, i, out, residual=None):
        self.out[i].copy_(out)
        if self.fused:
            self.res_out[i].copy_(residual)

    def mismatches(self, ca):
        """Every recorded call made again eagerly on its recorded inputs
        (on every rank, in the same order): the calls whose outputs differ
        in any bit from the replayed ones, as (call, elements) pairs."""
        torch, bad = self.torch, []
        for i in range(self.next):
            if self.fused:
                res = self.res_in[i].clone()
                hid = torch.full_like(res, float("nan"))
                ca.allreduce_add_rmsnorm(self.inp[i], res, self.weights[i], EPS, out=hid)
                got, want = (hid, res), (self.out[i], self.res_out[i])
            else:
                o = torch.full_like(self.inp[i], float("nan"))
                ca.allreduce(self.inp[i], out=o)
                got, want = (o,), (self.out[i],)
            n = sum(differing_bits(torch, g, w) for g, w in zip(got, want))
            if n:
                bad.append((i, n))
        torch.cuda.synchronize()
        ca.check()
        return bad


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
