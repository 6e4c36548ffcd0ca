"""What each rank runs in the GPU tests (test_gpu.py spawns the ranks).

Every case poisons its outputs, feeds values spread over many binades (so a
different summation order changes bits), and compares every output bit
with the rank-order float32 sum computed on the CPU from every rank's input
(each rank regenerates all inputs from seeds). A rank writes its results to
``<outdir>/rank<r>.json``: ``[[case, error or null], ...]``.
"""

import json
import math
import os
import struct
import time
import traceback

import torch
import torch.distributed as dist

import p2p_allreduce as pa

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
# Exponent range per dtype: wide, but no sum of up to 8 ranks overflows.
EXP = {torch.bfloat16: 60, torch.float16: 11, torch.float32: 60}


def rank_input(rank, n, dtype, seed, exp=None):
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    e = min(EXP[dtype], exp) if exp is not None else EXP[dtype]
    mant = 1.0 + torch.rand(n, generator=g, dtype=torch.float64)
    exp = torch.randint(-e, e, (n,), generator=g).double()
    sign = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
    x = (sign * mant * torch.pow(2.0, exp)).to(dtype)
    if n > 3:
        x[0] = -0.0  # a signed zero must come out as the sum says
    return x


def reference(world, n, dtype, seed, exp=None):
    acc = rank_input(0, n, dtype, seed, exp).float()
    for r in range(1, world):
        acc = acc + rank_input(r, n, dtype, seed, exp).float()
    return acc.to(dtype)


def _f32(v):
    """`v` rounded to the nearest float32 (ties to even)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def add_rmsnorm_ref(total, residual, weight, eps, hidden):
    """docs/numerics.md's fused op order, in CPU float32 tensor ops (each an
    IEEE operation rounded to nearest; no scalar shortcuts)."""
    dtype = total.dtype
    res_out = (total.float() + residual.float()).to(dtype)
    if total.numel() == 0:
        return res_out, res_out.clone()
    q = res_out.float().reshape(-1, hidden)
    rows = q.shape[0]
    chunks = (hidden + 7) // 8
    sq = torch.zeros(rows, chunks * 8, dtype=torch.float32)
    sq[:, :hidden] = q * q  # +0.0 padding leaves a sum of squares unchanged
    sq = sq.reshape(rows, chunks, 8)
    acc = sq[:, :, 0].clone()
    for j in range(1, 8):
        acc = acc + sq[:, :, j]
    s = 1
    while s < chunks:
        k = torch.arange(0, chunks, 2 * s)
        k = k[k + s < chunks]
        acc[:, k] = acc[:, k] + acc[:, k + s]
        s *= 2
    # inv per row in Python floats: torch's CPU sqrt need not be correctly
    # rounded (it may go through MKL's VML), IEEE's double sqrt is. Each
    # double result rounded once to float32 is the float32 operation's
    # result (double rounding is innocuous for + / sqrt from float32).
    eps32 = _f32(eps)
    inv = torch.tensor(
        [_f32(1.0 / _f32(math.sqrt(_f32(_f32(ss / hidden) + eps32)))) for ss in acc[:, 0].tolist()],
        dtype=torch.float32,
    )
    normed = (q * inv[:, None]) * weight.float()[None, :]
    return res_out, normed.to(dtype).reshape(-1)


def takes_push_ll(dtype, hidden, threads=512):
    """Whether the fused push_ll kernel takes rows of `hidden` (its register
    path: whole 8-element chunks, two per thread for 16-bit types, one for
    f32); other rows are refused with UsageError (docs/design/fused.md)."""
    return hidden % 8 == 0 and hidden // 8 <= (1 if dtype == torch.float32 else 2) * threads


def poison(t):
    t.view(BITS[t.dtype]).fill_(0x7BCD if t.element_size() == 2 else 0x7FBADBAD)


#: Mismatches of the current case. A case records them and goes on, so that
#: every rank still launches the same sequence of collectives (a rank that
#: left a case early would leave its peers waiting out one timeout per call).
MISMATCHES = []


def same_bits(got, want, what):
    try:
        _same_bits(got, want, what)
    except AssertionError as e:
        MISMATCHES.append(str(e))
        print(f"MISMATCH {e}", flush=True)


def _same_bits(got, want, what):
    got = got.detach().cpu().reshape(-1)
    want = want.reshape(-1)
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}")
    bad = (got.view(BITS[got.dtype]) != want.view(BITS[want.dtype])).nonzero()
    if len(bad):
        i = int(bad[0])
        raise AssertionError(
            f"{what}: {len(bad)} of {got.numel()} elements differ; first at {i}: {got[i].item()!r} vs {want[i].item()!r}"
        )


def expect(exc, fn, what):
    try:
        fn()
    except exc:
        return
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{what}: expected {exc.__name__}, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"{what}: expected {exc.__name__}, nothing raised")


class Cases:
    def __init__(self, rank, world, device):
        self.rank, self.world, self.dev = rank, world, device
        self.results = []

    def run(self, name, fn):
        MISMATCHES.clear()
        t0 = time.monotonic()
        try:
            fn()
            err = None if not MISMATCHES else f"{len(MISMATCHES)} mismatches, first: {MISMATCHES[0]}"
        except Exception:  # noqa: BLE001
            err = traceback.format_exc()
        self.results.append([name, err])
        took = time.monotonic() - t0
        print(f"rank {self.rank}: {'ok  ' if err is None else 'FAIL'} {name} ({took:.1f} s)", flush=True)

    def x(self, n, dtype, seed):
        return rank_input(self.rank, n, dtype, seed).to(self.dev)

    def ref(self, n, dtype, seed):
        return reference(self.world, n, dtype, seed)


LENGTHS = [1, 7, 8, 9, 1000, 4097, 65537, 300001]


def correctness(c, ca):
    stream = torch.cuda.current_stream(c.dev)
    seed = 1

    def eager():
        nonlocal seed
        for dtype in DTYPES:
            for n in LENGTHS:
                for algo in ["auto"] + (pa.algorithms() if n in (9, 4097) else []):
                    seed += 1
                    x = c.x(n, dtype, seed)
                    out = torch.empty_like(x)
                    poison(out)
                    ca.allreduce(x, out=out, algorithm=algo)
                    same_bits(out, c.ref(n, dtype, seed), f"staged {dtype} n={n} {algo}")
                    same_bits(x, rank_input(c.rank, n, dtype, seed), f"input kept {dtype} n={n}")
                seed += 1
                x = c.x(n, dtype, seed)
                r = ca.allreduce(x)
                assert r is x
                same_bits(x, c.ref(n, dtype, seed), f"in place {dtype} n={n}")
        ca.check()

    def misaligned():
        nonlocal seed
        for dtype in DTYPES:
            seed += 1
            n = 4099
            whole = torch.empty(n + 1, dtype=dtype, device=c.dev)
            whole[1:] = c.x(n, dtype, seed)
            view = whole[1:]
            assert view.data_ptr() % 16
            ca.allreduce(view)
            same_bits(view, c.ref(n, dtype, seed), f"misaligned view {dtype}")
        ca.check()

    def registered():
        nonlocal seed
        for dtype in DTYPES:
            buf = torch.empty(1 << 19, dtype=dtype, device=c.dev)
            ca.register_buffer(buf)
            for n in [1, 9, 4097, 65537]:
                for at in [0, 4096]:
                    seed += 1
                    buf[at : at + n] = c.x(n, dtype, seed)
                    out = torch.empty(n, dtype=dtype, device=c.dev)
                    poison(out)
                    ca.allreduce(buf[at : at + n], out=out)
                    assert ca.last_call[0] == "registered", ca.last_call
                    same_bits(out, c.ref(n, dtype, seed), f"registered {dtype} n={n} at {at}")
                    seed += 1
                    buf[at : at + n] = c.x(n, dtype, seed)
                    ca.allreduce(buf[at : at + n])
                    same_bits(buf[at : at + n], c.ref(n, dtype, seed), f"registered in place {dtype} n={n}")
            # The fused call reads its input from the registered buffer too.
            for rows, hidden in [(1, 7168), (3, 7), (4, 4096)]:
                for algo in ["one_stage", "two_stage", "push_ll"]:
                    seed += 1
                    n = rows * hidden
                    buf[:n] = rank_input(c.rank, n, dtype, seed, exp=40).to(c.dev)
                    res0 = rank_input(c.rank, n, dtype, seed + 50000, exp=40)
                    w = rank_input(c.rank, hidden, dtype, seed + 90000, exp=4)
                    residual, out = res0.to(c.dev), torch.empty(n, dtype=dtype, device=c.dev)
                    poison(out)
                    if algo == "push_ll" and not takes_push_ll(dtype, hidden):
                        expect(pa.UsageError, lambda: ca.allreduce_add_rmsnorm(buf[:n], residual, w.to(c.dev), 1e-6, out=out, algorithm=algo), f"registered fused push_ll hidden={hidden}")
                        same_bits(residual, res0, f"refused registered fused hidden={hidden}: residual untouched")
                        continue
                    ca.allreduce_add_rmsnorm(buf[:n], residual, w.to(c.dev), 1e-6, out=out, algorithm=algo)
                    assert ca.last_call[0] == "registered", ca.last_call
                    want_res, want_norm = add_rmsnorm_ref(reference(c.world, n, dtype, seed, 40), res0, w, 1e-6, hidden)
                    what = f"registered fused {dtype} rows={rows} hidden={hidden} {algo}"
                    same_bits(residual, want_res, what + " residual")
                    same_bits(out, want_norm, what + " normed")
        ca.check()

    def graphs(zero_copy):
        nonlocal seed
        n = 65537
        for dtype in DTYPES:
            xa = torch.empty(n, dtype=dtype, device=c.dev)
            xb = torch.empty(4097, dtype=dtype, device=c.dev)
            oa = torch.empty_like(xa)
            xa.copy_(c.x(n, dtype, 0))
            xb.copy_(c.x(4097, dtype, 0))
            ca.allreduce(xa, out=oa)  # warm-up outside capture
            torch.cuda.synchronize(c.dev)
            g = torch.cuda.CUDAGraph()
            with ca.capture(zero_copy=zero_copy):
                with torch.cuda.graph(g):
                    ca.allreduce(xa, out=oa)
                    want = "captured" if zero_copy else "staged"
                    assert ca.last_call[0] == want, ca.last_call
                    ca.allreduce(xb)
            for _ in range(4):
                seed += 1
                xa.copy_(c.x(n, dtype, seed))
                xb.copy_(c.x(4097, dtype, seed + 1000))
                poison(oa)
                g.replay()
                same_bits(oa, c.ref(n, dtype, seed), f"graph {dtype} out")
                same_bits(xb, c.ref(4097, dtype, seed + 1000), f"graph {dtype} in place")
            ca.check()
            del g
            # The fused call in a graph: new input and residual per replay.
            rows, hidden = 3, 4096
            fx = torch.empty(rows * hidden, dtype=dtype, device=c.dev)
            fres = torch.empty_like(fx)
            fw = rank_input(c.rank, hidden, dtype, 77, exp=4)
            fwd = fw.to(c.dev)
            fout = torch.empty_like(fx)
            fx.copy_(rank_input(c.rank, rows * hidden, dtype, 0, exp=40))
            fres.copy_(fx)
            ca.allreduce_add_rmsnorm(fx, fres, fwd, 1e-6, out=fout)  # warm-up outside capture
            torch.cuda.synchronize(c.dev)
            g = torch.cuda.CUDAGraph()
            with ca.capture(zero_copy=zero_copy):
                with torch.cuda.graph(g):
                    ca.allreduce_add_rmsnorm(fx, fres, fwd, 1e-6, out=fout)
                    assert ca.last_call[0] == ("captured" if zero_copy else "staged"), ca.last_call
            for _ in range(3):
                seed += 1
                res0 = rank_input(c.rank, rows * hidden, dtype, seed + 50000, exp=40)
                fx.copy_(rank_input(c.rank, rows * hidden, dtype, seed, exp=40))
                fres.copy_(res0)
                poison(fout)
                g.replay()
                want_res, want_norm = add_rmsnorm_ref(reference(c.world, rows * hidden, dtype, seed, 40), res0, fw, 1e-6, hidden)
                same_bits(fres, want_res, f"graph fused {dtype} residual")
                same_bits(fout, want_norm, f"graph fused {dtype} normed")
            ca.check()
            del g

    def refusals():
        x = torch.ones(16, device=c.dev)
        expect(pa.UsageError, lambda: ca.allreduce(x.cpu()), "CPU tensor")
        expect(pa.UsageError, lambda: ca.allreduce(torch.ones(4, 4, device=c.dev).t()), "non-contiguous")
        expect(pa.UsageError, lambda: ca.allreduce(torch.ones(16, dtype=torch.int32, device=c.dev)), "int32")
        expect(pa.UsageError, lambda: ca.allreduce(x, out=torch.empty(8, device=c.dev)), "out too short")
        expect(pa.UsageError, lambda: ca.allreduce(x, out=torch.empty(16, dtype=torch.half, device=c.dev)), "out dtype")
        expect(pa.UsageError, lambda: ca.allreduce(x, algorithm="fastest"), "unknown algorithm")
        if torch.cuda.device_count() > 1:
            other = torch.device("cuda", (c.dev.index + 1) % torch.cuda.device_count())
            expect(pa.UsageError, lambda: ca.allreduce(torch.ones(16, device=other)), "other device")
        assert not ca.should_use(x.cpu())
        assert not ca.should_use(torch.ones(4, dtype=torch.int32, device=c.dev))
        big = torch.empty(ca.max_size // 2 + 8, dtype=torch.bfloat16, device=c.dev)
        assert not ca.should_use(big)
        assert ca.should_use(torch.ones(2048, dtype=torch.bfloat16, device=c.dev)) == (ca.world > 1)
        # The group still works after refused calls.
        n = 1000
        x = c.x(n, torch.bfloat16, 999)
        ca.allreduce(x)
        same_bits(x, c.ref(n, torch.bfloat16, 999), "after refusals")
        ca.check()

    def fused():
        nonlocal seed
        for dtype in DTYPES:
            for rows, hidden in [(0, 7168), (1, 7168), (3, 7), (5, 1), (64, 4096), (17, 5120), (2, 8192), (300, 128), (7, 1000)]:
                for algo in ["auto", "one_stage", "two_stage", "push_ll"]:
                    seed += 1
                    n = rows * hidden
                    # Exponents within +-40: no sum of squares overflows.
                    x = rank_input(c.rank, n, dtype, seed, exp=40).to(c.dev)
                    res0 = rank_input(c.rank, n, dtype, seed + 50000, exp=40)
                    w = rank_input(c.rank, hidden, dtype, seed + 90000, exp=4)
                    residual = res0.to(c.dev)
                    weight = w.to(c.dev)
                    out = torch.empty_like(x)
                    poison(out)
                    if algo == "push_ll" and not takes_push_ll(dtype, hidden):
                        expect(pa.UsageError, lambda: ca.allreduce_add_rmsnorm(x.view(rows, hidden) if n else x, residual, weight, 1e-6, out=out, algorithm=algo), f"fused push_ll {dtype} hidden={hidden}")
                        same_bits(residual, res0, f"refused fused push_ll {dtype} hidden={hidden}: residual untouched")
                        continue
                    ca.allreduce_add_rmsnorm(x.view(rows, hidden) if n else x, residual, weight, 1e-6, out=out, algorithm=algo)
                    want_res, want_norm = add_rmsnorm_ref(reference(c.world, n, dtype, seed, 40), res0, w, 1e-6, hidden)
                    what = f"fused {dtype} rows={rows} hidden={hidden} {algo}"
                    same_bits(residual, want_res, what + " residual")
                    same_bits(out, want_norm, what + " normed")
        ca.check()

    c.run("eager staged, in place and out of place, all dtypes and algorithms", eager)
    c.run("misaligned views", misaligned)
    c.run("fused allreduce + residual add + RMSNorm, every hidden size, every algorithm", fused)
    c.run("registered buffers (zero-copy), two offsets", registered)
    c.run("CUDA graphs, zero-copy capture, new data each replay", lambda: graphs(True))
    c.run("CUDA graphs, staged capture, new data each replay", lambda: graphs(False))
    c.run("typed refusals and should_use", refusals)
    stream.synchronize()


def timeout_case(c, ca, dead):
    """Rank `dead` leaves; every other rank must get PeerTimeoutError naming it."""

    def body():
        x = c.x(4096, torch.bfloat16, 5)
        t0 = time.monotonic()
        ca.allreduce(x)
        try:
            ca.check()
        except pa.PeerTimeoutError as e:
            took = time.monotonic() - t0
            assert dead in e.peers, f"peers {e.peers} should name rank {dead}: {e}"
            assert e.barrier, e
            assert took < 2.0 + 10.0, f"took {took:.1f} s for a 2 s timeout"
            print(f"rank {c.rank}: PeerTimeoutError after {took:.2f} s: {e}", flush=True)
        else:
            raise AssertionError("no PeerTimeoutError with a dead peer")
        expect(pa.P2PAllreduceError, lambda: ca.allreduce(x), "call after a timeout")
        ca.reset(sync=False)
        ca.poll()

    c.run(f"a dead rank {dead} raises PeerTimeoutError naming it", body)


def mismatch_case(c, ca):
    """Issue 31: rank r allreduces 1000 + r elements; every rank must get
    GroupError naming the other (the kernels' call tags), never wrong sums;
    after reset() on every rank the group is exact again."""

    def body():
        other = 1 - c.rank
        x = c.x(1000 + c.rank, torch.float32, 11)
        ca.allreduce(x)
        try:
            ca.check()
        except pa.GroupError as e:
            assert other in e.peers, f"peers {e.peers} should name rank {other}: {e}"
            print(f"rank {c.rank}: GroupError: {e}", flush=True)
        else:
            raise AssertionError("no GroupError for a count off by one")
        dist.barrier()
        ca.reset()
        dist.barrier()
        x = c.x(1000, torch.float32, 12)
        same_bits(ca.allreduce(x), c.ref(1000, torch.float32, 12), "after reset")

    c.run("counts 1000 and 1001 raise GroupError naming the peer, then exact after reset", body)

    # Issue 43: the disagreements engines make differ by multiples of 256
    # elements (token counts at a hidden size), which an 8-bit tag could
    # not see: the shorter rank returned with wrong bits. Every algorithm.
    algorithms = ["one_stage", "two_stage", "push", "push_ll", "push_two_stage", "push_islands"]
    shapes = [
        ("3x7168 vs 4x7168 bf16", lambda r: (3 + r) * 7168, torch.bfloat16),
        ("1x8192 vs 2x8192 f16", lambda r: (1 + r) * 8192, torch.float16),
        ("1000 vs 1256 f32", lambda r: 1000 + 256 * r, torch.float32),
    ]

    def expect_group_error(what, call):
        call()
        try:
            ca.check()
        except pa.GroupError as e:
            assert other_rank in e.peers, f"{what}: peers {e.peers} should name rank {other_rank}: {e}"
        else:
            raise AssertionError(f"{what}: no GroupError: this rank returned Ok")
        dist.barrier()
        ca.reset()
        dist.barrier()

    other_rank = 1 - c.rank

    kept = []

    def in_graph(call):
        """``call`` captured (staged) in a CUDA graph, then replayed once;
        the graph is kept until the check has waited for it."""

        def run():
            g = torch.cuda.CUDAGraph()
            with ca.capture(zero_copy=False):
                with torch.cuda.graph(g):
                    call()
            g.replay()
            # The replay runs on the current stream, not the capture's.
            torch.cuda.synchronize(c.dev)
            kept.append(g)

        return run

    def engine_shapes():
        n = 0
        for name, count, dtype in shapes:
            for algo in algorithms:
                x = c.x(count(c.rank), dtype, 21)
                expect_group_error(f"{name} {algo}", lambda: ca.allreduce(x, algorithm=algo))
                expect_group_error(f"{name} {algo} (graph)", in_graph(lambda: ca.allreduce(x, algorithm=algo)))
                kept.clear()
                n += 2
        for algo in ["one_stage", "two_stage", "push_ll"]:
            rows = 3 + c.rank
            x = c.x(rows * 7168, torch.bfloat16, 22).view(rows, 7168)
            res = c.x(rows * 7168, torch.bfloat16, 23).view(rows, 7168)
            w = torch.ones(7168, dtype=torch.bfloat16, device=c.dev)
            expect_group_error(
                f"fused 3 vs 4 rows of 7168 {algo}",
                lambda: ca.allreduce_add_rmsnorm(x, res, w, algorithm=algo),
            )
            n += 1
        x = c.x(7168, torch.float32, 24)
        same_bits(ca.allreduce(x), c.ref(7168, torch.float32, 24), "after the engine shapes")
        print(f"rank {c.rank}: {n} engine-shape disagreements raised GroupError", flush=True)

    c.run("engine shapes (token counts at hidden sizes, +256, fused rows) raise GroupError on every algorithm", engine_shapes)


def adapter_cases(c, world, group):
    """The engine-facing object (p2p_allreduce.integrations) on the real
    kernels: what SGLang and vLLM call, out of place, in a graph inside
    capture(), and the fused op with a fresh residual."""
    from p2p_allreduce.integrations import EngineAllreduce

    state = {}

    def make():
        state["e"] = EngineAllreduce(group, c.dev, max_size=1 << 20)
        assert not state["e"].disabled, state["e"].reason

    c.run("adapter: enabled on every rank", make)
    e = state.get("e")
    if e is None:
        return

    def out_of_place():
        for dtype in DTYPES:
            for n in (8, 4097, 21504):
                x = c.x(n, dtype, 500 + n)
                before = x.clone()
                assert e.takes(x)
                out = e.reduced(x)
                torch.cuda.current_stream(c.dev).synchronize()
                same_bits(out, c.ref(n, dtype, 500 + n), f"adapter reduced {dtype} n={n}")
                same_bits(x, before.cpu(), "adapter input untouched")
                assert out.data_ptr() != x.data_ptr()
        # What is not ours: other dtypes, too large, empty.
        assert not e.takes(torch.zeros(4, dtype=torch.int32, device=c.dev))
        assert not e.takes(torch.zeros((1 << 20) // 2 + 8, dtype=torch.bfloat16, device=c.dev))
        assert not e.takes(torch.zeros(0, dtype=torch.bfloat16, device=c.dev))
        # Rank-invariant: an unaligned view is still ours (staged).
        assert e.takes(torch.zeros(9, dtype=torch.bfloat16, device=c.dev)[1:])

    c.run("adapter: out of place, every dtype", out_of_place)

    def in_graph():
        n = 3 * 7168
        x = c.x(n, torch.bfloat16, 900)
        outs = []
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(c.dev)
        s.wait_stream(torch.cuda.current_stream(c.dev))
        with e.capture(), torch.cuda.stream(s):
            # As the engines do: warm-up inside capture(), not captured, on
            # the stream the graph is then captured on.
            e.reduced(x)
            with torch.cuda.graph(g, stream=s):
                outs.append(e.reduced(x))
        poison(outs[0])
        g.replay()
        torch.cuda.synchronize(c.dev)
        same_bits(outs[0], c.ref(n, torch.bfloat16, 900), "adapter in a graph")
        assert e.ca.last_call[0] == "captured", e.ca.last_call

    c.run("adapter: captured in a CUDA graph", in_graph)

    def fused():
        rows, hidden = 3, 1024
        x = c.x(rows * hidden, torch.bfloat16, 901).view(rows, hidden)
        g = torch.Generator().manual_seed(77)
        res = torch.randn(rows, hidden, generator=g).to(torch.bfloat16).to(c.dev)
        w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16).to(c.dev)
        before = res.clone()
        normed, new_res = e.add_rmsnorm(x, res, w, 1e-6)
        torch.cuda.synchronize(c.dev)
        same_bits(res, before.cpu(), "adapter fused: input residual untouched")
        total = c.ref(rows * hidden, torch.bfloat16, 901).view(rows, hidden)
        want_res = (total.float() + before.cpu().float()).to(torch.bfloat16)
        same_bits(new_res, want_res, "adapter fused residual = sum + residual")
        assert normed.shape == x.shape and not torch.isnan(normed.float()).any()

    c.run("adapter: fused allreduce + add + RMSNorm", fused)
    e.close()


def main(rank, world, devices, port, outdir, mode):
    dev = torch.device("cuda", devices[rank])
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    c = Cases(rank, world, dev)
    timeout = {"timeout": 2.0, "mismatch": 0.5}.get(mode, 5.0)
    ca = None

    def make():
        nonlocal ca
        ca = pa.CustomAllreduce(device=dev, timeout=timeout)

    if mode == "adapter":
        adapter_cases(c, world, dist.group.WORLD)
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(c.results, f)
        dist.barrier()
        dist.destroy_process_group()
        return
    c.run("construct inside torch.distributed", make)
    if ca is not None:
        if mode == "timeout":
            dead = world - 1
            dist.barrier()
            if rank == dead:
                os._exit(0)
            time.sleep(0.5)
            timeout_case(c, ca, dead)
        elif mode == "mismatch":
            mismatch_case(c, ca)
        else:
            correctness(c, ca)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(c.results, f)
    if mode == "timeout":
        os._exit(0)  # a peer is gone: skip the collective teardown
    dist.barrier()
    ca = None
    dist.destroy_process_group()
