"""bench_tp.py's step on each backend: the model shard and its step, the
recorded calls, capture and timing of graphs, and the cross-rank checks."""

import math

#: --attention: torch's SDPA backends by name (torch.nn.attention.SDPBackend).
ATTENTION = {"auto": None, "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH",
             "cudnn": "CUDNN_ATTENTION"}
#: symm-mem runs one-shot up to this many bytes, two-shot above.
SYMM_ONE_SHOT_MAX = 512 << 10
EPS = 1e-6


class Failed(Exception):
    """A check where bits must agree did not."""


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
    both ways, which it does not when ranks share a GPU (docs/design/python.md)."""

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
