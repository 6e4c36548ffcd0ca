"""SGLang: its tensor-parallel groups' custom allreduce becomes ours, and so
does the fused allreduce + residual add + RMSNorm at the layer boundaries.

    from p2p_allreduce.integrations import sglang as p2p_sglang
    p2p_sglang.install()          # before SGLang builds its groups

or, with nothing changed in the program, ``P2P_ALLREDUCE_ENGINE=sglang``: the
wheel registers an SGLang general plugin (entry point ``sglang.srt.plugins``)
that SGLang loads in every process it starts (server, scheduler, workers),
and the plugin calls ``install()`` when the variable names SGLang.

What ``install()`` changes, in this process (SGLang's files are untouched):

- ``...device_communicators.custom_all_reduce.dispatch_custom_allreduce``
  returns our class, so every group SGLang gives a custom allreduce (the
  tensor-parallel and attention-TP groups; ``--disable-custom-all-reduce``
  still turns it off) gets ours: ``GroupCoordinator.all_reduce`` asks
  ``should_custom_ar`` and calls ``custom_all_reduce`` through its
  ``outplace_all_reduce`` op; its graph capture enters ``capture()``.
  What we do not take goes down SGLang's own chain (PyNCCL).
- With ``fused=True`` (the default): the layer boundaries' fused
  allreduce + residual add + RMSNorm (FlashInfer's, where SGLang fuses that
  step) runs ours on a group whose custom allreduce is ours: the predicate
  ``flashinfer_ar_fusion_applies`` (in the three modules that import it) says
  yes for up to ``FUSE_ALLREDUCE_MAX_BATCH_SIZE`` tokens, and
  ``flashinfer_allreduce_residual_rmsnorm`` returns our fresh
  ``(normed, residual)``; it declines (``(None, None)``) wherever our group is
  off or the message does not fit, and SGLang then runs its unfused path.
- Deterministic: SGLang's ``--enable-deterministic-inference`` turns custom
  allreduce off (and pins NCCL to ``allreduce:tree`` with a fixed channel
  count). With ours installed it stays on instead, in deterministic mode:
  every allreduce of the group on our kernels, at every size (the same bits
  whatever the batch). ``set_custom_all_reduce`` (in ``parallel_state`` and
  where ``bootstrap`` imported it) is wrapped to keep it on in that mode,
  unless ``--disable-custom-all-reduce`` was given explicitly; ``install()``
  and the group's first log line say so. ``P2P_ALLREDUCE_DETERMINISTIC=1``
  does the same without SGLang's mode.
"""

import importlib
import logging
import os

from ._adapter import EngineAllreduce, enabled_by_env

logger = logging.getLogger("p2p_allreduce")

_CA = "sglang.srt.distributed.device_communicators.custom_all_reduce"
_PARALLEL_STATE = "sglang.srt.distributed.parallel_state"
#: Modules that imported ``set_custom_all_reduce`` by name.
_SETTER_HOMES = (_PARALLEL_STATE, "sglang.srt.distributed.bootstrap")
_FUSION = "sglang.srt.layers.flashinfer_comm_fusion"
#: Modules that imported the fusion predicate by name.
_PREDICATE_HOMES = (
    "sglang.srt.layers.layer_boundary.residual.add_norm",
    "sglang.srt.layers.layer_boundary.fusions.allreduce",
    "sglang.srt.layers.layer_boundary.exit",
)

_state = {}


class P2PCustomAllreduce(EngineAllreduce):
    """The object SGLang's GroupCoordinator keeps as ``ca_comm``."""

    engine = "sglang"

    def __init__(self, group, device, max_size: int = 8 << 20, **kwargs):
        EngineAllreduce.__init__(self, group, device, max_size, backend=kwargs.pop("_p2p_backend", None))

    def engine_deterministic(self):
        return "--enable-deterministic-inference" if deterministic_inference() else None

    def should_custom_ar(self, inp) -> bool:
        return self.takes(inp)

    def custom_all_reduce(self, input):  # noqa: A002 - SGLang's parameter name
        return self.reduced(input)

    def fused_allreduce_rmsnorm(self, input_, residual_inp_, weight_, eps):
        """SGLang's generic hook (its ROCm path calls it): ``(normed,
        residual)`` as new tensors, or None where we do not take it."""
        if not self.takes_fused(input_, residual_inp_, weight_):
            return None
        return self.add_rmsnorm(input_, residual_inp_, weight_, eps)

    def takes_fused(self, x, residual, weight) -> bool:
        """Rank-invariant: dtype, shapes and size only."""
        if not self.takes(x) or weight.dim() != 1 or weight.numel() == 0:
            return False
        return (residual.shape == x.shape and residual.dtype == x.dtype == weight.dtype
                and x.numel() % weight.numel() == 0 and x.shape[-1] == weight.numel())

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _dispatch(group, device):
    """Replaces SGLang's dispatch_custom_allreduce: always our class."""
    return P2PCustomAllreduce


def _group_for(use_attn_tp_group: bool):
    """The GroupCoordinator SGLang's fused op reduces over."""
    if use_attn_tp_group:
        return importlib.import_module("sglang.srt.distributed.parallel_state").get_attn_tp_group()
    return importlib.import_module("sglang.srt.layers.moe").post_experts_reduction_group()


def _ours(coordinator):
    ca = getattr(coordinator, "ca_comm", None)
    return ca if isinstance(ca, P2PCustomAllreduce) and not ca.disabled else None


def _fusion_applies(batch_size: int) -> bool:
    """Our fused op takes the layer boundaries of this batch: our group is on
    for the TP group (the same answer on every rank)."""
    try:
        if importlib.import_module("sglang.srt.layers.dp_attention").is_dp_attention_enabled():
            return False
        tp = importlib.import_module("sglang.srt.distributed.parallel_state").get_tp_group()
    except Exception:  # noqa: BLE001 - groups not built yet
        return False
    limit = getattr(importlib.import_module(_PREDICATE_HOMES[0]), "FUSE_ALLREDUCE_MAX_BATCH_SIZE", 2048)
    return _ours(tp) is not None and 0 < batch_size <= limit


def _fused(input_tensor, residual, weight, eps=1e-6, max_token_num=2048, use_oneshot=None,
           trigger_completion_at_end=False, fp32_acc=True, use_attn_tp_group=True):
    """Replaces flashinfer_allreduce_residual_rmsnorm: ``(normed, residual)``
    as new tensors (the input residual is not written, as SGLang's callers
    expect), or ``(None, None)`` to decline."""
    try:
        ca = _ours(_group_for(use_attn_tp_group))
    except Exception:  # noqa: BLE001
        ca = None
    if ca is None or not ca.takes_fused(input_tensor, residual, weight):
        return None, None
    op = _state.get("op")
    if op is not None:
        return op(input_tensor, residual, weight, float(eps), _register(ca))
    return ca.add_rmsnorm(input_tensor, residual, weight, eps)


_groups = {}


def _register(ca) -> int:
    key = id(ca)
    _groups[key] = ca
    return key


def _make_op():
    """Our fused call as a torch custom op, so torch.compile sees one opaque
    call with a shape rule instead of tracing pointer arithmetic."""
    try:
        import torch
        from torch.library import custom_op
    except ImportError:
        return None

    @custom_op("p2p_allreduce::sglang_add_rmsnorm", mutates_args=())
    def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                    group: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _groups[group].add_rmsnorm(x, residual, weight, eps)

    @add_rmsnorm.register_fake
    def _(x, residual, weight, eps, group):
        return torch.empty_like(x), torch.empty_like(residual)

    return add_rmsnorm


def deterministic_inference() -> bool:
    """Whether SGLang's ``--enable-deterministic-inference`` is on (its
    resolved execution settings; False before SGLang published them)."""
    rc = importlib.import_module("sglang.srt.runtime_context")
    try:
        return bool(rc.get_exec().deterministic.enable_deterministic_inference)
    except (ValueError, AttributeError):  # not published yet, or another layout
        return False


def _user_disabled_custom_all_reduce() -> bool:
    """Whether ``--disable-custom-all-reduce`` was given (the raw argument,
    not what SGLang resolved from other flags)."""
    rc = importlib.import_module("sglang.srt.runtime_context")
    try:
        return bool(getattr(rc.get_server_args(), "disable_custom_all_reduce", False))
    except (ValueError, AttributeError):
        return False


def _set_custom_all_reduce(enable: bool):
    """Replaces SGLang's set_custom_all_reduce: keeps custom allreduce (ours)
    on where SGLang's deterministic inference alone turned it off."""
    if not enable and deterministic_inference() and not _user_disabled_custom_all_reduce():
        enable = True
        logger.info("p2p_allreduce (sglang): --enable-deterministic-inference turns custom allreduce off; ours stays "
                    "on in deterministic mode (every allreduce of the group on our kernels, the same bits at every "
                    "size and batch) instead of NCCL's allreduce:tree")
    return _state["set_custom_all_reduce"](enable)


def _mode_note() -> str:
    from .. import routing

    if deterministic_inference():
        why = "--enable-deterministic-inference"
    elif routing.deterministic_from_env():
        why = f"{routing.ENV_DETERMINISTIC}=1"
    else:
        return "; sizes the tuned table measured faster on NCCL go to SGLang's NCCL"
    return (f"; {why}: deterministic mode, every allreduce of the group on our kernels (the same bits at every "
            "size and batch) instead of stepping aside for NCCL")


def installed() -> bool:
    return getattr(importlib.import_module(_CA), "dispatch_custom_allreduce", None) is _dispatch


def install(*, fused: bool = True) -> bool:
    """Makes SGLang's custom allreduce ours (and, with ``fused``, its fused
    allreduce + add + RMSNorm), in this process; idempotent. Call it before
    SGLang builds its groups. Returns False if it was installed already."""
    ca_mod = importlib.import_module(_CA)
    if ca_mod.dispatch_custom_allreduce is _dispatch:
        return False
    _state["dispatch"] = ca_mod.dispatch_custom_allreduce
    ca_mod.dispatch_custom_allreduce = _dispatch
    _state["set_custom_all_reduce"] = importlib.import_module(_PARALLEL_STATE).set_custom_all_reduce
    _state["setters"] = []
    for name in _SETTER_HOMES:
        try:
            m = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - another SGLang layout: the other home still works
            logger.warning("p2p_allreduce: %s not importable (%s): deterministic inference may turn our "
                           "custom allreduce off there", name, e)
            continue
        if getattr(m, "set_custom_all_reduce", None) is _state["set_custom_all_reduce"]:
            m.set_custom_all_reduce = _set_custom_all_reduce
            _state["setters"].append(name)
    if fused:
        fusion = importlib.import_module(_FUSION)
        _state["fused"] = fusion.flashinfer_allreduce_residual_rmsnorm
        fusion.flashinfer_allreduce_residual_rmsnorm = _fused
        _state["op"] = _state.get("op") or _make_op()
        _state["predicates"] = {}
        for name in _PREDICATE_HOMES:
            m = importlib.import_module(name)
            _state["predicates"][name] = m.flashinfer_ar_fusion_applies
            m.flashinfer_ar_fusion_applies = _fusion_applies
    logger.info("p2p_allreduce: installed into SGLang (custom allreduce%s)%s",
                " and fused allreduce + residual + RMSNorm" if fused else "", _mode_note())
    return True


def uninstall() -> None:
    """Puts SGLang's functions back (groups made meanwhile keep ours)."""
    if "dispatch" in _state:
        importlib.import_module(_CA).dispatch_custom_allreduce = _state.pop("dispatch")
    for name in _state.pop("setters", []):
        importlib.import_module(name).set_custom_all_reduce = _state["set_custom_all_reduce"]
    if "fused" in _state:
        importlib.import_module(_FUSION).flashinfer_allreduce_residual_rmsnorm = _state.pop("fused")
    for name, f in _state.pop("predicates", {}).items():
        importlib.import_module(name).flashinfer_ar_fusion_applies = f


def plugin() -> None:
    """SGLang general plugin (``sglang.srt.plugins``): installs when
    ``P2P_ALLREDUCE_ENGINE`` names SGLang; otherwise does nothing."""
    if enabled_by_env("sglang"):
        install(fused=os.environ.get("P2P_ALLREDUCE_FUSED", "1") != "0")
