"""bench_tp.py's model shapes: the presets and one rank's shard of a model
at a tensor-parallel size."""

#: Model shapes. deepseek-v3-dense: DeepSeek-V3's hidden size, depth and
#: dense-layer MLP width, with its attention modelled as grouped-query
#: attention of 56 x 128 heads (8 KV heads) instead of MLA, and every layer
#: dense instead of MoE.
PRESETS = {
    "deepseek-v3-dense": dict(hidden=7168, layers=61, intermediate=18432, heads=56, kv_heads=8, head_dim=128),
    "llama-70b": dict(hidden=8192, layers=80, intermediate=28672, heads=64, kv_heads=8, head_dim=128),
}


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
