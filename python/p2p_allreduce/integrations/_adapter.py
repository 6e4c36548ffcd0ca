"""The object an engine keeps as its "custom allreduce": our
``CustomAllreduce`` behind the method names SGLang and vLLM call on theirs.

Invariants an engine relies on, kept here:

- **Every rank takes the same path.** Whether a tensor comes to us
  (``should_custom_ar``) depends only on what is the same on every rank of a
  tensor-parallel group: dtype, element count, device kind, contiguity and
  the group's settings; never on a pointer's alignment (we stage what is not
  aligned). Whether the group is enabled at all is voted once, at
  construction, over the engine's CPU group: a rank that cannot take part
  (no driver, another host, a failed setup) disables every rank, which then
  fall back to the engine's own path (NCCL), and nothing waits for it.
- **Out of place.** ``custom_all_reduce`` returns a new tensor and never
  writes its input (both engines wrap it in a custom op declared so).
- **Graphs.** ``capture()`` is entered by the engine around its CUDA-graph
  capture; allreduces captured inside read the captured tensors directly and
  their buffers are exchanged when it exits; outside a stream capture (the
  engine's warm-up runs) every call is a real allreduce.
- **NCCL where it is faster.** Sizes the machine's table
  (``p2p-allreduce tune``) measured NCCL faster at are not taken, so the
  engine's own NCCL path runs them, unless the group is deterministic.
- **Deterministic.** ``P2P_ALLREDUCE_DETERMINISTIC=1``, or the engine's own
  deterministic mode (vLLM's ``VLLM_BATCH_INVARIANT=1``, SGLang's
  ``--enable-deterministic-inference``), puts the group in deterministic
  mode: every size goes to our kernels (messages above ``max_size`` in
  chunks), so a token's sum has the same bits whatever the batch, instead
  of crossing into the engine's NCCL at some size. Decided once, at
  construction, the same on every rank (any rank asking for it turns it on
  for all).
"""

import contextlib
import logging
import os
import socket
from typing import Callable, Optional

logger = logging.getLogger("p2p_allreduce")

#: The dtypes the kernels take, by torch's name.
_DTYPES = ("torch.float32", "torch.float16", "torch.bfloat16")


def host_identity() -> str:
    """This machine's name and boot: ranks that differ here cannot share
    device memory through CUDA IPC."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


def _local_readiness(device) -> Optional[str]:
    """Why this rank cannot take part, or None. Nothing collective."""
    try:
        import torch

        from .. import driver_present
    except ImportError as e:  # pragma: no cover - the package imports torch lazily
        return f"import failed: {e}"
    if not driver_present():
        return "no CUDA driver on this machine"
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda":
        return f"device {device} is not a CUDA device"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


class EngineAllreduce:
    """One rank's custom allreduce for an engine's tensor-parallel group.

    ``group``: the engine's CPU (gloo) process group; ``device``: this
    rank's CUDA device; ``max_size``: the largest message in bytes (the
    group's staging and scratch per rank). ``zero_copy_graphs=False``:
    captured allreduces copy their input into our buffers (one extra copy
    per replay) instead of exchanging the captured tensors' IPC handles;
    for engines whose graph memory is not IPC-exportable (cuMem pools).
    ``backend``: for tests, a callable ``(group, device, max_size) ->
    object`` with CustomAllreduce's methods. ``deterministic``: force the
    mode (``None``: ``P2P_ALLREDUCE_DETERMINISTIC`` or the engine's own
    deterministic mode, ``engine_deterministic()``).
    """

    #: The engine's name in log lines.
    engine = "engine"
    #: For tests without a GPU: the backend factory every new instance uses
    #: when the engine builds one (engines pass no ``backend``).
    test_backend: Optional[Callable] = None

    def __init__(self, group, device, max_size: int = 8 << 20, *, zero_copy_graphs: bool = True,
                 backend: Optional[Callable] = None, deterministic: Optional[bool] = None):
        import torch.distributed as dist

        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.max_size = int(max_size)
        self.zero_copy_graphs = zero_copy_graphs
        self.disabled = True
        #: Why the group is off (None when on).
        self.reason: Optional[str] = None
        self.ca = None
        self._first_call_logged = False
        #: Why this rank asks for deterministic mode (None: it does not).
        self.deterministic_reason: Optional[str] = self._deterministic_reason(deterministic)
        #: Deterministic mode, as the ranks agreed at construction.
        self.deterministic = self.deterministic_reason is not None
        self._build(dist, backend if backend is not None else EngineAllreduce.test_backend)

    # ---- mode -----------------------------------------------------------
    def engine_deterministic(self) -> Optional[str]:
        """The engine's own deterministic mode as a reason (e.g.
        "VLLM_BATCH_INVARIANT=1"), or None. Engines override it."""
        return None

    def _deterministic_reason(self, forced: Optional[bool]) -> Optional[str]:
        from .. import routing

        if forced is not None:
            return "deterministic=True" if forced else None
        if routing.deterministic_from_env():
            return f"{routing.ENV_DETERMINISTIC}=1"
        try:
            return self.engine_deterministic()
        except Exception as e:  # noqa: BLE001 - an engine layout we do not know: say so, assume not
            logger.warning("p2p_allreduce (%s): cannot read the engine's deterministic mode: %s", self.engine, e)
            return None

    # ---- setup -----------------------------------------------------------
    def _vote(self, dist, mine):
        got: list = [None] * self.world_size
        dist.all_gather_object(got, mine, group=self.group)
        return got

    def _build(self, dist, backend):
        if self.world_size < 2:
            self.reason = "a group of one rank has nothing to reduce"
            return
        if self.world_size > 8:
            self.reason = f"{self.world_size} ranks: the kernels take at most 8"
            return
        why = None if backend is not None else _local_readiness(self.device)
        votes = self._vote(dist, (why, host_identity(), self.deterministic_reason))
        # Deterministic if any rank asks: every rank must route alike.
        asked = [d for _, _, d in votes if d is not None]
        if asked and self.deterministic_reason is None:
            self.deterministic_reason = f"{asked[0]} on another rank"
        self.deterministic = bool(asked)
        votes = [(w, h) for w, h, _ in votes]
        hosts = {h for _, h in votes}
        if len(hosts) > 1:
            self.reason = "the group spans several hosts (CUDA IPC is within one host): the engine's NCCL path runs"
        else:
            bad = [(r, w) for r, (w, _) in enumerate(votes) if w is not None]
            if bad:
                self.reason = f"rank {bad[0][0]} cannot take part: {bad[0][1]}"
        if self.reason is None:
            err = None
            try:
                if backend is not None:
                    self.ca = backend(self.group, self.device, self.max_size)
                else:
                    from ..custom_allreduce import CustomAllreduce

                    self.ca = CustomAllreduce(self.group, self.device, max_size=self.max_size,
                                              deterministic=self.deterministic)
            except Exception as e:  # noqa: BLE001 - any failure disables every rank, below
                err = f"{type(e).__name__}: {e}"
            # Setup succeeded everywhere, or nowhere is it used.
            fails = [(r, e) for r, (e, _) in enumerate(self._vote(dist, (err, None))) if e is not None]
            if fails:
                self.reason = f"setup failed on rank {fails[0][0]}: {fails[0][1]}"
                if self.ca is not None:
                    self.ca.close()
                    self.ca = None
        self.disabled = self.reason is not None
        if self.rank == 0:
            if self.disabled:
                logger.info("p2p_allreduce (%s): off for this group of %d ranks: %s", self.engine, self.world_size,
                            self.reason)
            else:
                logger.info("p2p_allreduce (%s): on for a group of %d ranks (link %s, max %d bytes), %s", self.engine,
                            self.world_size, getattr(self.ca, "link", "?"), self.max_size, self.mode_line())

    def mode_line(self) -> str:
        """The routing mode in words, for the log."""
        if self.deterministic:
            return (f"deterministic mode ({self.deterministic_reason}): every allreduce on our kernels, the same "
                    "bits at every size and batch (above max_size in chunks)")
        bands = getattr(self.ca, "nccl_bands", None) or []
        to_nccl = [b for b in bands if b[1] != "ours"]
        if not to_nccl:
            return "fastest mode: no size measured faster on NCCL"
        low, parts = 0, []
        for up_to, who, _margin in bands:
            if who != "ours":
                parts.append(f"{who} {low + 1}..{'' if up_to is None else up_to} B")
            low = up_to if up_to is not None else low
        return "fastest mode: the engine's NCCL takes " + ", ".join(parts) + " (measured faster by p2p-allreduce tune)"

    # ---- the gate ------------------------------------------------------------
    def takes(self, t) -> bool:
        """Whether ``t`` comes to us: a contiguous float32/float16/bfloat16
        CUDA tensor, in an enabled group; of at most ``max_size`` bytes and
        a size the table does not give to NCCL, unless the group is
        deterministic (then every size: larger ones run in chunks). The same
        answer on every rank for the same shape and dtype."""
        if self.disabled:
            return False
        if str(t.dtype) not in _DTYPES or not t.is_contiguous() or t.numel() == 0:
            return False
        if t.device.type != "cuda" and not getattr(self.ca, "accepts_cpu", False):
            return False
        if self.deterministic:
            return True
        n = t.numel() * t.element_size()
        if n > self.max_size:
            return False
        backend_for = getattr(self.ca, "backend_for", None)
        return backend_for is None or backend_for(n) == "ours"

    # ---- calls ---------------------------------------------------------------
    def reduced(self, t):
        """The sum over the ranks, in a new tensor."""
        import torch

        out = torch.empty_like(t, memory_format=torch.contiguous_format)
        self.ca.allreduce(t, out=out)
        self._log_first(t, "allreduce")
        return out

    def add_rmsnorm(self, x, residual, weight, eps):
        """``(rmsnorm(sum + residual) * weight, sum + residual)``, both new
        tensors; ``residual`` is not written."""
        import torch

        new_residual = residual.clone(memory_format=torch.contiguous_format)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        self.ca.allreduce_add_rmsnorm(x, new_residual, weight, eps, out=out)
        self._log_first(x, "allreduce + add + RMSNorm")
        return out, new_residual

    def _log_first(self, t, what):
        if not self._first_call_logged:
            self._first_call_logged = True
            if self.rank == 0:
                logger.info("p2p_allreduce (%s): first %s: %s %s -> %s", self.engine, what, tuple(t.shape), t.dtype,
                            getattr(self.ca, "last_call", None))

    @contextlib.contextmanager
    def capture(self):
        """Entered by the engine around its CUDA-graph capture."""
        if self.disabled:
            yield
            return
        with self.ca.capture(zero_copy=self.zero_copy_graphs):
            yield

    def close(self):
        if self.ca is not None:
            self.ca.close()
            self.ca = None
        self.disabled = True
        if self.reason is None:
            self.reason = "closed"


def enabled_by_env(engine: str) -> bool:
    """Whether ``P2P_ALLREDUCE_ENGINE`` switches the adapter for ``engine`` on:
    its name, a list naming it, or ``1``/``auto``/``all``."""
    v = os.environ.get("P2P_ALLREDUCE_ENGINE", "").strip().lower()
    names = {s.strip() for s in v.split(",") if s.strip()}
    return engine in names or bool(names & {"1", "auto", "all", "on", "true"})
