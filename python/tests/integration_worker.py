"""What each rank runs in test_integrations.py: two CPU processes over gloo,
the real engine package imported, our adapter installed, and the engine's
own objects (SGLang's GroupCoordinator, vLLM's CudaCommunicator dispatch)
driving it. Where no GPU exists our kernels cannot run, so the routing
cases give the adapter a stand-in backend that sums over gloo (the
adapter's `test_backend` hook); the setup cases use no stand-in. Each rank
writes ``<outdir>/rank<r>.json``: ``[[case, error or null], ...]``."""

import importlib.util
import json
import os
import sys
import traceback
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F


class GlooSum:
    """Stand-in for CustomAllreduce on CPU tensors: the rank-order sum over
    gloo, and the fused op as allreduce + add + torch's rms_norm."""

    accepts_cpu = True
    link = "gloo (test)"
    calls = []

    def __init__(self, group, device, max_size):
        self.group, self.last_call = group, None
        self.captures = 0

    def allreduce(self, t, out=None):
        got = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(got, t.contiguous(), group=self.group)
        acc = got[0].float()
        for g in got[1:]:
            acc = acc + g.float()
        out.copy_(acc.to(t.dtype))
        GlooSum.calls.append(("allreduce", tuple(t.shape)))
        self.last_call = ("staged", "gloo")
        return out

    def allreduce_add_rmsnorm(self, x, residual, weight, eps, out=None):
        s = torch.empty_like(x)
        self.allreduce(x, out=s)
        residual.add_(s)
        out.copy_(F.rms_norm(residual, (weight.numel(),), weight, eps))
        GlooSum.calls.append(("fused", tuple(x.shape)))
        return out, residual

    def capture(self, zero_copy=True):
        import contextlib

        self.captures += 1
        return contextlib.nullcontext()

    def close(self):
        pass


def rank_data(rank, n=64, dtype=torch.float32):
    g = torch.Generator().manual_seed(1234 + rank)
    # Spread over binades, so a different order of adds changes bits.
    return (torch.randn(n, generator=g, dtype=torch.float64) * torch.pow(2.0, torch.randint(-20, 20, (n,), generator=g))).to(dtype)


def rank_order_sum(world, n=64, dtype=torch.float32):
    acc = rank_data(0, n, dtype).float()
    for r in range(1, world):
        acc = acc + rank_data(r, n, dtype).float()
    return acc.to(dtype)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32 if a.element_size() == 4 else torch.int16), b.view(torch.int32 if b.element_size() == 4 else torch.int16))


def main(rank, world, port, outdir, engine):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)), backend="gloo")
    results = []

    def case(name, fn):
        try:
            fn()
            results.append([name, None])
        except Exception:  # noqa: BLE001 - reported per case
            results.append([name, traceback.format_exc()])
        dist.barrier()

    from p2p_allreduce.integrations import _adapter

    if engine == "vllm":
        run_vllm(rank, world, group, case, _adapter)
    else:
        run_sglang(rank, world, group, case, _adapter)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def common_setup_cases(rank, world, group, case, _adapter, build):
    """Setup as the engine does it, with no stand-in: every rank agrees."""
    import p2p_allreduce as pa

    def without_gpu():
        ca = build()
        if pa.driver_present():
            return  # covered on GPU machines by test_gpu.py
        assert ca.disabled, "no driver, yet enabled"
        assert "no CUDA driver" in ca.reason, ca.reason
        got = [None] * world
        dist.all_gather_object(got, ca.reason, group=group)
        assert len(set(got)) == 1, f"ranks disagree on why: {got}"
        x = rank_data(rank).cuda() if torch.cuda.is_available() else rank_data(rank)
        assert not ca.should_custom_ar(x)

    def other_host():
        real = _adapter.host_identity
        _adapter.host_identity = lambda: f"host{rank}/boot"
        _adapter.EngineAllreduce.test_backend = GlooSum
        try:
            ca = build()
        finally:
            _adapter.host_identity = real
            _adapter.EngineAllreduce.test_backend = None
        assert ca.disabled and "several hosts" in ca.reason, ca.reason
        assert ca.ca is None, "a backend was built for a group across hosts"

    def one_rank_fails_setup():
        def flaky(g, d, m):
            if rank == world - 1:
                raise RuntimeError("out of device memory (test)")
            return GlooSum(g, d, m)

        _adapter.EngineAllreduce.test_backend = flaky
        try:
            ca = build()
        finally:
            _adapter.EngineAllreduce.test_backend = None
        assert ca.disabled, "a rank failed its setup, yet this rank is enabled"
        assert f"rank {world - 1}" in ca.reason and "out of device memory" in ca.reason, ca.reason

    case("setup without a GPU disables every rank", without_gpu)
    case("a group across hosts is off before any setup", other_host)
    case("one rank's failed setup disables every rank", one_rank_fails_setup)


def run_vllm(rank, world, group, case, _adapter):
    import vllm.distributed.device_communicators.custom_all_reduce as m
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    from p2p_allreduce.integrations import vllm as p2p_vllm

    def installs():
        os.environ.pop("P2P_ALLREDUCE_ENGINE", None)
        p2p_vllm.plugin()
        assert not p2p_vllm.installed(), "the plugin installed without P2P_ALLREDUCE_ENGINE"
        os.environ["P2P_ALLREDUCE_ENGINE"] = "vllm"
        p2p_vllm.plugin()
        assert p2p_vllm.installed()
        assert not p2p_vllm.install(), "a second install changed something"
        cls = m.CustomAllreduce
        assert issubclass(cls, cls._p2p_original) and cls._p2p_original.__module__ == m.__name__
        assert os.environ.get("VLLM_ALLREDUCE_USE_FLASHINFER") == "0"
        import vllm.config.vllm as cfg

        assert cfg.OPTIMIZATION_LEVEL_02["compilation_config"]["pass_config"]["fuse_allreduce_rms"] is False

    case("install, plugin and env", installs)

    def build():
        # As CudaCommunicator.__init__ builds it, for the TP group's CPU group.
        return m.CustomAllreduce(group=group, device=torch.device("cuda:0"), symm_mem_enabled=False,
                                 register_graph_buffers=True)

    common_setup_cases(rank, world, group, case, _adapter, build)

    def routed():
        _adapter.EngineAllreduce.test_backend = GlooSum
        try:
            ca = build()
        finally:
            _adapter.EngineAllreduce.test_backend = None
        assert not ca.disabled, ca.reason
        # vLLM's own dispatch (CudaCommunicator.all_reduce) over a
        # communicator whose other backends are absent, as on a machine
        # where only the custom allreduce and NCCL exist.
        comm = types.SimpleNamespace(
            fi_ar_comm=None, pynccl_comm=None, qr_comm=None, fi_pcie_ipc_ar_comm=None, aiter_ar_comm=None,
            use_aiter_allreduce=False, symm_mem_comm=None, ca_comm=ca, device_group=group)
        x = rank_data(rank)
        before = x.clone()
        GlooSum.calls.clear()
        out = CudaCommunicator.all_reduce(comm, x)
        assert GlooSum.calls == [("allreduce", (64,))], GlooSum.calls
        assert same_bits(out, rank_order_sum(world)), "wrong sum"
        assert same_bits(x, before) and out.data_ptr() != x.data_ptr(), "not out of place"
        # What we do not take goes down vLLM's own path.
        big = torch.ones((ca.max_size // 4) + 4, dtype=torch.float32)
        ints = torch.arange(16, dtype=torch.int32)
        assert not ca.should_custom_ar(big) and not ca.should_custom_ar(ints)
        GlooSum.calls.clear()
        got = CudaCommunicator.all_reduce(comm, ints)
        assert GlooSum.calls == [] and torch.equal(got, ints * world), "int32 was not left to vLLM"
        assert CudaCommunicator.custom_all_gather(comm, x) is None
        assert CudaCommunicator.custom_reduce_scatter(comm, x) is None
        with ca.capture():
            pass
        assert ca.ca.captures == 1

    case("vLLM's dispatch calls ours, and falls back for the rest", routed)

    def batch_invariant():
        # vLLM's own flag, read the way vLLM reads it (vllm.envs).
        import logging

        import vllm.envs as envs

        os.environ["VLLM_BATCH_INVARIANT"] = "1"
        seen = []
        handler = logging.Handler()
        handler.emit = lambda record: seen.append(record.getMessage())
        log = logging.getLogger("p2p_allreduce")
        log.addHandler(handler)
        old_level = log.level
        log.setLevel(logging.INFO)
        _adapter.EngineAllreduce.test_backend = GlooSum
        try:
            assert envs.VLLM_BATCH_INVARIANT, "vLLM does not see VLLM_BATCH_INVARIANT=1"
            assert p2p_vllm.batch_invariant() == "VLLM_BATCH_INVARIANT=1"
            p2p_vllm.uninstall()
            assert p2p_vllm.install()
            assert any("VLLM_BATCH_INVARIANT=1: deterministic mode" in m for m in seen), seen
            ca = build()
        finally:
            _adapter.EngineAllreduce.test_backend = None
            os.environ.pop("VLLM_BATCH_INVARIANT", None)
            log.removeHandler(handler)
            log.setLevel(old_level)
        assert not ca.disabled, ca.reason
        assert ca.deterministic and ca.deterministic_reason == "VLLM_BATCH_INVARIANT=1", ca.deterministic_reason
        if rank == 0:
            assert any("deterministic mode (VLLM_BATCH_INVARIANT=1)" in m for m in seen), seen
        # Every size comes to us, above max_size too: a token's sum keeps
        # its bits whatever the batch.
        comm = types.SimpleNamespace(
            fi_ar_comm=None, pynccl_comm=None, qr_comm=None, fi_pcie_ipc_ar_comm=None, aiter_ar_comm=None,
            use_aiter_allreduce=False, symm_mem_comm=None, ca_comm=ca, device_group=group)
        big = rank_data(rank, (ca.max_size // 4) + 4)
        assert ca.should_custom_ar(big)
        GlooSum.calls.clear()
        out = CudaCommunicator.all_reduce(comm, big)
        assert GlooSum.calls == [("allreduce", tuple(big.shape))], GlooSum.calls
        assert same_bits(out, rank_order_sum(world, big.numel())), "wrong sum"
        # Without the flag, the same size is left to vLLM.
        _adapter.EngineAllreduce.test_backend = GlooSum
        try:
            plain = build()
        finally:
            _adapter.EngineAllreduce.test_backend = None
        assert not plain.deterministic and not plain.should_custom_ar(big)

    case("VLLM_BATCH_INVARIANT=1: ours in deterministic mode at every size", batch_invariant)


def run_sglang(rank, world, group, case, _adapter):
    import sglang.srt.distributed.device_communicators.custom_all_reduce as cam
    import sglang.srt.distributed.parallel_state as ps
    import sglang.srt.layers.dp_attention as dpa
    import sglang.srt.layers.flashinfer_comm_fusion as fusion
    import sglang.srt.layers.layer_boundary.exit as exit_mod
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    from p2p_allreduce.integrations import sglang as p2p_sglang

    def installs():
        os.environ.pop("P2P_ALLREDUCE_ENGINE", None)
        p2p_sglang.plugin()
        assert not p2p_sglang.installed(), "the plugin installed without P2P_ALLREDUCE_ENGINE"
        os.environ["P2P_ALLREDUCE_ENGINE"] = "sglang"
        p2p_sglang.plugin()
        assert p2p_sglang.installed()
        assert not p2p_sglang.install()
        assert cam.dispatch_custom_allreduce(group=group, device=torch.device("cuda:0")) is \
            p2p_sglang.P2PCustomAllreduce
        assert exit_mod.flashinfer_ar_fusion_applies is p2p_sglang._fusion_applies

    case("install, plugin and env", installs)

    def coordinator():
        # SGLang's own group object, as its parallel state builds the TP group.
        return GroupCoordinator(group_ranks=[list(range(world))], local_rank=rank, torch_distributed_backend="gloo",
                                use_pynccl=False, use_mscclpp=False, use_custom_allreduce=True,
                                use_torch_symm_mem_all_reduce=False, use_hpu_communicator=False,
                                use_xpu_communicator=False)

    def build():
        c = coordinator()
        assert isinstance(c.ca_comm, p2p_sglang.P2PCustomAllreduce), type(c.ca_comm)
        return c.ca_comm

    common_setup_cases(rank, world, group, case, _adapter, build)

    def routed():
        _adapter.EngineAllreduce.test_backend = GlooSum
        try:
            c = coordinator()
        finally:
            _adapter.EngineAllreduce.test_backend = None
        assert not c.ca_comm.disabled, c.ca_comm.reason
        x = rank_data(rank)
        before = x.clone()
        GlooSum.calls.clear()
        out = c._all_reduce_out_place(x, "auto")  # what SGLang's outplace_all_reduce op runs
        assert GlooSum.calls == [("allreduce", (64,))], GlooSum.calls
        assert same_bits(out, rank_order_sum(world)) and same_bits(x, before)
        with c.ca_comm.capture():  # what SGLang's graph_capture enters (it needs CUDA itself)
            pass
        assert c.ca_comm.ca.captures == 1

        # The fused op at the layer boundaries, through SGLang's names.
        real = (ps.get_attn_tp_group, ps.get_tp_group, dpa.is_dp_attention_enabled)
        ps.get_attn_tp_group = ps.get_tp_group = lambda: c
        dpa.is_dp_attention_enabled = lambda: False
        try:
            assert exit_mod.flashinfer_ar_fusion_applies(3) and not exit_mod.flashinfer_ar_fusion_applies(0)
            h = 16
            xs = rank_data(rank, 3 * h).view(3, h)
            g = torch.Generator().manual_seed(7)
            res = torch.randn(3, h, generator=g)
            w = 1 + 0.1 * torch.randn(h, generator=g)
            res_before = res.clone()
            GlooSum.calls.clear()
            normed, new_res = fusion.flashinfer_allreduce_residual_rmsnorm(
                input_tensor=xs, residual=res, weight=w, eps=1e-6, use_attn_tp_group=True)
            assert GlooSum.calls and GlooSum.calls[-1] == ("fused", (3, h)), GlooSum.calls
            assert same_bits(res, res_before), "the input residual was written"
            want_res = (rank_order_sum(world, 3 * h).view(3, h).float() + res_before.float()).to(torch.float32)
            assert same_bits(new_res, want_res), "fused residual != sum + residual"
            assert same_bits(normed, F.rms_norm(want_res, (h,), w, 1e-6))
            # Shapes it does not take: declined, SGLang runs its own path.
            assert fusion.flashinfer_allreduce_residual_rmsnorm(
                input_tensor=xs, residual=res, weight=w[:8], eps=1e-6) == (None, None)
        finally:
            ps.get_attn_tp_group, ps.get_tp_group, dpa.is_dp_attention_enabled = real

    case("SGLang's group and fused op call ours", routed)

    def deterministic_inference():
        # What --enable-deterministic-inference leaves in SGLang's resolved
        # settings (its `_handle_deterministic_inference` declares
        # disable_custom_all_reduce=True; the raw argument stays False), seen
        # through the runtime-context getters SGLang's code reads; SGLang's
        # own setter (as bootstrap calls it) and GroupCoordinator do the rest.
        import sglang.srt.runtime_context as rc

        # bootstrap (which calls set_custom_all_reduce at startup) imports
        # gated_launch, an HTTP gate that needs fastapi and uvicorn, which
        # the pinned test environment leaves out: a stand-in for it only.
        if importlib.util.find_spec("uvicorn") is None:
            gate = types.ModuleType("sglang.srt.distributed.gated_launch")
            gate.maybe_wait_for_gated_launch = lambda **kwargs: None
            sys.modules.setdefault("sglang.srt.distributed.gated_launch", gate)
        import sglang.srt.distributed.bootstrap as boot

        # Installed before bootstrap could be imported: again, so that its
        # setter is wrapped as in a server process.
        p2p_sglang.uninstall()
        assert p2p_sglang.install()

        real = (rc.get_exec, rc.get_server_args)
        resolved = types.SimpleNamespace(
            deterministic=types.SimpleNamespace(enable_deterministic_inference=True),
            comm=types.SimpleNamespace(disable_custom_all_reduce=True))
        raw = types.SimpleNamespace(disable_custom_all_reduce=False, enable_deterministic_inference=True)
        rc.get_exec, rc.get_server_args = (lambda: resolved), (lambda: raw)
        _adapter.EngineAllreduce.test_backend = GlooSum
        try:
            assert boot.set_custom_all_reduce is p2p_sglang._set_custom_all_reduce, "bootstrap's setter not wrapped"
            boot.set_custom_all_reduce(not resolved.comm.disable_custom_all_reduce)
            assert ps._ENABLE_CUSTOM_ALL_REDUCE is True, "deterministic inference turned ours off"
            # As init_model_parallel_group passes it for the TP group.
            c = GroupCoordinator(group_ranks=[list(range(world))], local_rank=rank, torch_distributed_backend="gloo",
                                 use_pynccl=False, use_mscclpp=False, use_custom_allreduce=ps._ENABLE_CUSTOM_ALL_REDUCE,
                                 use_torch_symm_mem_all_reduce=False, use_hpu_communicator=False,
                                 use_xpu_communicator=False)
            ca = c.ca_comm
            assert isinstance(ca, p2p_sglang.P2PCustomAllreduce) and not ca.disabled, getattr(ca, "reason", ca)
            assert ca.deterministic and ca.deterministic_reason == "--enable-deterministic-inference", \
                ca.deterministic_reason
            big = rank_data(rank, (ca.max_size // 4) + 4)
            GlooSum.calls.clear()
            out = c._all_reduce_out_place(big, "auto")
            assert GlooSum.calls == [("allreduce", tuple(big.shape))], GlooSum.calls
            assert same_bits(out, rank_order_sum(world, big.numel()))
            # --disable-custom-all-reduce given explicitly still wins.
            raw.disable_custom_all_reduce = True
            boot.set_custom_all_reduce(False)
            assert ps._ENABLE_CUSTOM_ALL_REDUCE is False
        finally:
            ps.set_custom_all_reduce(True)
            rc.get_exec, rc.get_server_args = real
            _adapter.EngineAllreduce.test_backend = None

    case("--enable-deterministic-inference keeps ours on, in deterministic mode", deterministic_inference)
