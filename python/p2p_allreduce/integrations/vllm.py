"""vLLM: its tensor-parallel group's custom allreduce becomes ours.

    from p2p_allreduce.integrations import vllm as p2p_vllm
    p2p_vllm.install()            # before vLLM builds its engine

or, with nothing changed in the program, ``P2P_ALLREDUCE_ENGINE=vllm``: the
wheel registers a vLLM general plugin (entry point ``vllm.general_plugins``)
that vLLM loads in every process it starts, and the plugin calls
``install()`` when the variable names vLLM.

What ``install()`` changes, in this process (vLLM's files are untouched):

- ``vllm.distributed.device_communicators.custom_all_reduce.CustomAllreduce``
  becomes a subclass of vLLM's class whose instances are ours: the CUDA
  communicator builds it for the tensor-parallel group as it builds its own
  (``disable_custom_all_reduce`` still turns it off), asks
  ``should_custom_ar`` for each allreduce and calls ``custom_all_reduce``;
  its graph capture enters ``capture()``. What we do not take (other
  dtypes, messages above ``max_size``, a group spanning hosts, a rank that
  cannot take part) goes down vLLM's own chain (symmetric memory, PyNCCL).
- Unless ``flashinfer=True``: ``VLLM_ALLREDUCE_USE_FLASHINFER=0`` (where it is
  not set), because vLLM tries FlashInfer's allreduce before the custom one;
  and the optimisation levels' default for the compile pass that fuses
  allreduce + RMSNorm into FlashInfer's kernel becomes off (an explicit
  ``-cc.pass_config.fuse_allreduce_rms=True`` still turns it on). Both give
  other bits than the rank-order sum, and the fused pass takes those
  allreduces away from the communicator.

Deterministic: with vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``,
in which vLLM turns its FlashInfer and fused allreduce off and pins NCCL to
one tree channel), our group runs in deterministic mode: every allreduce of
the tensor-parallel group on our kernels, at every size (the same bits
whatever the batch), rather than any size going to NCCL. ``install()`` says
so in its log line. ``P2P_ALLREDUCE_DETERMINISTIC=1`` does the same without
batch invariance.
"""

import logging
import os

from ._adapter import EngineAllreduce, enabled_by_env

logger = logging.getLogger("p2p_allreduce")

_MODULE = "vllm.distributed.device_communicators.custom_all_reduce"


class _VllmMethods(EngineAllreduce):
    """The methods vLLM's CudaCommunicator and GroupCoordinator call."""

    engine = "vllm"

    def __init__(self, group, device, max_size: int = 8192 * 1024, *args, symm_mem_enabled: bool = False,
                 register_graph_buffers: bool = True, **kwargs):
        # vLLM's other sizes (all-gather, reduce-scatter, MNNVL) are for
        # collectives we do not offer; register_graph_buffers=False means
        # its graph memory cannot be exported, so captures are staged.
        EngineAllreduce.__init__(self, group, device, max_size, zero_copy_graphs=register_graph_buffers,
                                 backend=kwargs.pop("_p2p_backend", None))
        self.symm_mem_enabled = symm_mem_enabled
        # Attributes vLLM's model code reads: our group offers none of
        # their paths.
        self.fully_connected = False
        self.mnnvl_only = False
        self.mnnvl_lamport_ag_multicast_ptr = 0

    def engine_deterministic(self):
        return batch_invariant()

    def should_custom_ar(self, inp) -> bool:
        return self.takes(inp)

    def custom_all_reduce(self, input):  # noqa: A002 - vLLM's parameter name
        return self.reduced(input)

    # vLLM asks its custom allreduce for these whenever it exists; None
    # sends them down its own path.
    def custom_all_gather(self, inp):
        return None

    def custom_reduce_scatter(self, inp):
        return None

    def should_custom_all_gather(self, inp) -> bool:
        return False

    def should_custom_reduce_scatter(self, inp) -> bool:
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _ours_on(orig):
    """A subclass of vLLM's class (so its static helpers and isinstance
    checks still work) whose instances are ours."""
    return type("P2PCustomAllreduce", (_VllmMethods, orig), {"__module__": __name__, "_p2p_original": orig})


def batch_invariant():
    """"VLLM_BATCH_INVARIANT=1" when vLLM's batch-invariant mode is on (as
    vLLM reads it, ``vllm.envs``), else None."""
    import importlib

    envs = importlib.import_module("vllm.envs")
    return "VLLM_BATCH_INVARIANT=1" if getattr(envs, "VLLM_BATCH_INVARIANT", False) else None


def _mode_note() -> str:
    from .. import routing

    why = batch_invariant() or (f"{routing.ENV_DETERMINISTIC}=1" if routing.deterministic_from_env() else None)
    if why:
        return (f"; {why}: deterministic mode, every tensor-parallel allreduce on our kernels (the same bits at "
                "every size and batch) instead of vLLM's NCCL")
    return "; sizes the tuned table measured faster on NCCL go to vLLM's NCCL"


def installed() -> bool:
    import importlib

    m = importlib.import_module(_MODULE)
    return getattr(m.CustomAllreduce, "_p2p_original", None) is not None


def install(*, flashinfer: bool = False) -> bool:
    """Makes vLLM's tensor-parallel custom allreduce ours, in this process
    (idempotent). Call it before vLLM builds its engine. Returns False if
    it was installed already."""
    import importlib

    m = importlib.import_module(_MODULE)
    if getattr(m.CustomAllreduce, "_p2p_original", None) is not None:
        return False
    m.CustomAllreduce = _ours_on(m.CustomAllreduce)
    if not flashinfer:
        os.environ.setdefault("VLLM_ALLREDUCE_USE_FLASHINFER", "0")
        _fusion_pass_default_off()
    logger.info("p2p_allreduce: installed into vLLM (%s.CustomAllreduce)%s", _MODULE, _mode_note())
    return True


def uninstall() -> None:
    """Puts vLLM's class back (groups made meanwhile keep ours)."""
    import importlib

    m = importlib.import_module(_MODULE)
    orig = getattr(m.CustomAllreduce, "_p2p_original", None)
    if orig is not None:
        m.CustomAllreduce = orig


def _fusion_pass_default_off() -> None:
    """The optimisation levels' default for ``fuse_allreduce_rms`` becomes
    False where it is vLLM's own rule (an explicit setting still wins)."""
    try:
        cfg = __import__("vllm.config.vllm", fromlist=["enable_allreduce_rms_fusion"])
    except Exception as e:  # noqa: BLE001 - another vLLM layout: say so, change nothing
        logger.warning("p2p_allreduce: vLLM's compile-pass defaults not found (%s): pass "
                       "-cc.pass_config.fuse_allreduce_rms=False yourself", e)
        return
    rule = getattr(cfg, "enable_allreduce_rms_fusion", None)
    changed = 0
    for name in dir(cfg):
        if not name.startswith("OPTIMIZATION_LEVEL_"):
            continue
        passes = getattr(cfg, name, {}).get("compilation_config", {}).get("pass_config", {})
        if rule is not None and passes.get("fuse_allreduce_rms") is rule:
            passes["fuse_allreduce_rms"] = False
            changed += 1
    if not changed:
        logger.warning("p2p_allreduce: vLLM's fuse_allreduce_rms default was not found: pass "
                       "-cc.pass_config.fuse_allreduce_rms=False so allreduces reach the communicator")


def plugin() -> None:
    """vLLM general plugin (``vllm.general_plugins``): installs when
    ``P2P_ALLREDUCE_ENGINE`` names vLLM; otherwise does nothing."""
    if enabled_by_env("vllm"):
        install(flashinfer=os.environ.get("P2P_ALLREDUCE_FLASHINFER", "0") == "1")
