"""``CustomAllreduce``: p2p-allreduce's ProcessGroup behind the interface
that serving engines give their custom allreduce.

Three routes, picked per call:

- **staged** (eager, any tensor): the input is copied into this rank's
  staging buffer, then the kernel runs; in place or into ``out``;
- **registered** (eager, zero-copy): the input lies inside a buffer passed to
  ``register_buffer`` on every rank; peers read it where it is;
- **captured** (CUDA graphs, zero-copy): inside ``with ca.capture():`` an
  allreduce captured by ``torch.cuda.graph`` reads the captured tensor
  itself; leaving ``capture()`` exchanges the captured buffers' IPC handles
  (every rank, same order), so replays read the peers' tensors directly.
  ``ca.capture(zero_copy=False)`` captures the staged route instead (one
  extra copy per replay). Either way, wrap the graph capture in
  ``ca.capture()``: it orders the group's earlier calls before the capture
  stream's (a graph is captured on a stream of its own).

Every route gives the same bits: the rank-order float32 sum, rounded once.

Which allreduces come here at all (``should_use``) also follows the
machine's table (``p2p-allreduce tune``, which times NCCL beside our
kernels): sizes it measured NCCL faster at are left to the engine's NCCL,
unless the group is in deterministic mode (``deterministic=True`` or
``P2P_ALLREDUCE_DETERMINISTIC=1``), which keeps every size up to
``max_size`` on our kernels. See ``p2p_allreduce.routing`` for what each
mode guarantees about bits.
"""

import contextlib
from typing import Callable, List, Optional

from . import _native, routing
from .errors import UsageError

#: torch dtype (as ``str(tensor.dtype)``) -> the kernels' dtype name.
DTYPES = {"torch.float32": "f32", "torch.float16": "f16", "torch.bfloat16": "bf16"}

#: Outputs and zero-copy inputs must start on this many bytes.
ALIGN = 16

#: On PCIe without a table from ``p2p-allreduce tune``, ``should_use`` keeps
#: to messages this small (the built-in PCIe table is not measured).
PCIE_UNTUNED_MAX = 512 << 10


class TorchExchange:
    """All-gather of bytes over a ``torch.distributed`` group (what the
    group's setup and registration calls exchange: IPC handles, settings)."""

    def __init__(self, group, device):
        import torch.distributed as dist

        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def __call__(self, data: bytes) -> List[bytes]:
        import torch
        import torch.distributed as dist

        out: list = [None] * self.world
        # all_gather_object over NCCL stages through the current device.
        with torch.cuda.device(self.device):
            dist.all_gather_object(out, bytes(data), group=self.group)
        return [bytes(b) for b in out]


def _overlaps(a, b) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


class CustomAllreduce:
    """One rank of a deterministic allreduce group; one process per GPU (or
    several processes on one GPU).

    Construct it on every rank of an initialised ``torch.distributed``
    group (any backend: the group only carries the setup exchange)::

        ca = CustomAllreduce(group=tp_group, device=torch.device("cuda", local_rank))
        if ca.should_use(x):
            x = ca.allreduce(x)          # in place, on the current stream

    ``max_size``: staging and scratch bytes per rank; larger staged messages
    run in chunks, and ``should_use`` says no above it. ``timeout``: seconds
    a kernel waits for a peer before it gives up (``PeerTimeoutError`` from
    ``check()``). ``algorithm``: "auto" (the tuned or built-in table) or one
    of ``p2p_allreduce.algorithms()``. ``exchange``: a callable
    ``f(bytes) -> list[bytes]`` with ``rank`` and ``world`` attributes, to
    set up without ``torch.distributed``. ``deterministic``: keep every
    size up to ``max_size`` on our kernels even where the table measured
    NCCL faster (``None``: ``P2P_ALLREDUCE_DETERMINISTIC=1`` turns it on);
    off, ``should_use`` leaves those sizes to NCCL.
    """

    def __init__(
        self,
        group=None,
        device=None,
        *,
        max_size: int = 8 << 20,
        timeout: float = 10.0,
        algorithm: str = "auto",
        exchange: Optional[Callable[[bytes], List[bytes]]] = None,
        deterministic: Optional[bool] = None,
    ):
        if algorithm != "auto" and algorithm not in _native.algorithms():
            raise UsageError(f"algorithm {algorithm!r} is not 'auto' or one of {_native.algorithms()}")
        import torch

        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        device = torch.device(device)
        if device.type != "cuda":
            raise UsageError(f"device {device} is not a CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if exchange is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise UsageError(
                    "CustomAllreduce needs an initialised torch.distributed process group "
                    "(torch.distributed.init_process_group, one process per GPU), or exchange="
                )
            exchange = TorchExchange(group if group is not None else dist.group.WORLD, device)
        # torch must own the device's primary context before we retain it.
        torch.cuda.init()
        with torch.cuda.device(device):
            torch.empty(0, device=device)
        self.device = device
        self.algorithm = algorithm
        self._exchange = exchange
        self._native = _native.Group(
            exchange.rank, exchange.world, device.index, exchange, max_bytes=max_size, timeout_s=timeout
        )
        #: Every size up to max_size on our kernels (see ``routing``).
        self.deterministic = routing.deterministic_from_env() if deterministic is None else bool(deterministic)
        #: Who the table gives each size to: ``[(up_to, winner, margin)]``.
        self.nccl_bands = list(self._native.nccl_bands)
        routing.check_bands(self.nccl_bands)
        self._in_capture = False
        self._zero_copy = True
        self._last_stream: Optional[int] = None
        self._registered: list = []
        #: The route and algorithm of the last call, e.g. ("staged", "one_stage").
        self.last_call = None

    # ---- the group -------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._group().rank

    @property
    def world(self) -> int:
        return self._group().world

    @property
    def link(self) -> str:
        """"nvlink", "pcie" or "same_device": the link to the slowest peer."""
        return self._group().link

    @property
    def max_size(self) -> int:
        return self._group().max_bytes

    def _group(self):
        if self._native is None:
            raise UsageError("this CustomAllreduce is closed")
        return self._native

    def _stream(self) -> int:
        import torch

        return torch.cuda.current_stream(self.device).cuda_stream

    # ---- checks ------------------------------------------------------------
    def _kind(self, t, what: str) -> str:
        import torch

        if not isinstance(t, torch.Tensor):
            raise UsageError(f"{what} is a {type(t).__name__}, not a torch.Tensor")
        dt = DTYPES.get(str(t.dtype))
        if dt is None:
            raise UsageError(f"{what} has dtype {t.dtype}; supported: torch.float32, torch.float16, torch.bfloat16")
        if t.device.type != "cuda":
            raise UsageError(f"{what} is on {t.device}, not a CUDA device: move it to {self.device}")
        if t.device != self.device:
            raise UsageError(f"{what} is on {t.device} but this rank's group is on {self.device}")
        if not t.is_contiguous():
            raise UsageError(f"{what} is not contiguous: pass tensor.contiguous()")
        return dt

    def should_use(self, tensor) -> bool:
        """Whether this allreduce should go to us rather than NCCL: a
        supported, contiguous, 16-byte aligned CUDA tensor on this rank's
        device, at most ``max_size`` bytes, in a group of 2 ranks or more,
        of a size the table does not give to NCCL (unless
        ``deterministic``); on PCIe without a tuned table
        (``p2p-allreduce tune``), at most 512 KiB."""
        try:
            self._kind(tensor, "tensor")
        except UsageError:
            return False
        g = self._group()
        n = tensor.nbytes
        if g.world < 2 or n > g.max_bytes or tensor.data_ptr() % ALIGN:
            return False
        if g.link == "pcie" and not g.tuned and n > PCIE_UNTUNED_MAX:
            return False
        return self.backend_for(n) == routing.OURS

    def backend_for(self, nbytes: int) -> str:
        """Who runs a message of ``nbytes`` bytes: "ours", or "nccl" /
        "nccl_symmetric" where the table measured NCCL faster and the
        group is not deterministic. The same on every rank."""
        if self.world < 2:
            return routing.OURS
        return routing.route(self.nccl_bands, nbytes, self.deterministic)

    def choose(self, tensor) -> str:
        """What runs ``tensor``'s allreduce: the algorithm ``allreduce``
        would run, or "nccl" where the table gives its size to NCCL (and
        the group is not deterministic): ``should_use`` then says no."""
        dt = self._kind(tensor, "tensor")
        if self.backend_for(tensor.nbytes) != routing.OURS:
            return routing.NCCL
        return self._group().choose(dt, tensor.numel(), self.algorithm)

    # ---- allreduce -----------------------------------------------------------
    def allreduce(self, tensor, out=None, *, algorithm: Optional[str] = None):
        """Sums ``tensor`` over the ranks on the current stream, in place, or
        into ``out`` (same dtype, shape and device). Returns the result.
        Every rank must call it with the same dtype and element count:
        ranks that do not get ``GroupError`` from ``check()`` (the kernels'
        call tags, docs/design/call-tags.md)."""
        g = self._group()
        dt = self._kind(tensor, "tensor")
        if out is not None:
            if self._kind(out, "out") != dt or out.numel() != tensor.numel():
                raise UsageError(
                    f"out ({out.dtype}, {out.numel()} elements) must match tensor ({tensor.dtype}, {tensor.numel()})"
                )
        dst = tensor if out is None else out
        algo = algorithm or self.algorithm
        stream = self._stream()
        n = tensor.numel()
        aligned_in = tensor.data_ptr() % ALIGN == 0
        route = "staged"
        if aligned_in and self._in_capture and self._zero_copy and g.is_capturing(stream):
            route = "captured"
        elif aligned_in and g.is_registered(tensor.data_ptr()):
            route = "registered"
        # Zero-copy outputs must not overlap the input the peers read;
        # every output must be aligned.
        direct = dst.data_ptr() % ALIGN == 0 and (route == "staged" or not _overlaps(dst, tensor))
        target = dst if direct else torch_empty_like(dst)
        call = {
            "staged": g.allreduce,
            "registered": g.allreduce_registered,
            "captured": g.allreduce_in_graph,
        }[route]
        used = call(stream, dt, n, tensor.data_ptr(), target.data_ptr(), algo)
        self._last_stream = stream
        if target is not dst:
            # When this rank's kernel is done the peers are done reading its
            # input (End barrier, or Mid for two-stage), so copy-back is safe.
            dst.copy_(target)
        self.last_call = (route, used)
        return dst

    def allreduce_add_rmsnorm(self, x, residual, weight, eps: float = 1e-6, out=None, *, algorithm: Optional[str] = None):
        """The allreduce fused with the residual add and RMSNorm that
        follow it in a transformer block, on the current stream:
        ``residual <- allreduce(x) + residual`` (in place) and
        ``out <- rmsnorm(residual) * weight``, with the exact operation
        order of docs/numerics.md (batch-invariant, identical on every
        rank). ``x`` and ``residual``: ``rows x hidden`` (any shape with
        that many elements), ``weight``: ``hidden`` elements, all one dtype.
        Returns ``(out, residual)``. "auto", "one_stage", "two_stage" or
        "push_ll" (flag-in-data lines: no barrier; the rows must fit its
        landing zone when zero-copy).
        Routes as ``allreduce``: zero-copy inside ``capture()`` and for
        ``x`` inside a registered buffer, staged otherwise."""
        g = self._group()
        dt = self._kind(x, "x")
        for t, what in ((residual, "residual"), (weight, "weight")):
            if self._kind(t, what) != dt:
                raise UsageError(f"{what} has dtype {t.dtype}, x {x.dtype}: use one dtype")
        hidden = weight.numel()
        if residual.numel() != x.numel():
            raise UsageError(f"residual has {residual.numel()} elements, x {x.numel()}: they must match")
        if hidden == 0 or x.numel() % hidden:
            raise UsageError(f"x has {x.numel()} elements, not whole rows of hidden size {hidden} (weight's length)")
        if out is None:
            out = torch_empty_like(x)
        elif self._kind(out, "out") != dt or out.numel() != x.numel():
            raise UsageError(f"out ({out.dtype}, {out.numel()} elements) must match x ({x.dtype}, {x.numel()})")
        if any(_overlaps(out, t) for t in (x, residual, weight)):
            raise UsageError("out overlaps x, residual or weight: pass a separate output")
        # The kernels need 16-byte aligned residual, weight and output.
        res = residual if residual.data_ptr() % ALIGN == 0 else residual.clone()
        w = weight if weight.data_ptr() % ALIGN == 0 else weight.clone()
        o = out if out.data_ptr() % ALIGN == 0 else torch_empty_like(out)
        stream = self._stream()
        # Zero-copy as allreduce() decides, unless the residual shares
        # memory with the input the peers read.
        route = "staged"
        if x.data_ptr() % ALIGN == 0 and not _overlaps(res, x):
            if self._in_capture and self._zero_copy and g.is_capturing(stream):
                route = "captured"
            elif g.is_registered(x.data_ptr()):
                route = "registered"
        algo = algorithm or (self.algorithm if self.algorithm in ("one_stage", "two_stage", "push_ll") else "auto")
        used = g.allreduce_add_rmsnorm(
            route, stream, dt, x.numel() // hidden, hidden, float(eps), x.data_ptr(), res.data_ptr(), w.data_ptr(),
            o.data_ptr(), algo,
        )
        self._last_stream = stream
        if res is not residual:
            residual.copy_(res)
        if o is not out:
            out.copy_(o)
        self.last_call = (route, used)
        return out, residual

    def register_buffer(self, tensor) -> None:
        """Registers ``tensor`` (every rank its own, same size, same order):
        a collective call. Later allreduces of tensors inside it, at the same
        offset on every rank, are zero-copy. The group keeps the tensor
        alive. Its memory must come from ``cudaMalloc`` (torch's default
        allocator; not ``expandable_segments``)."""
        self._kind(tensor, "tensor")
        self._group().register_buffer(self._exchange, tensor.data_ptr(), tensor.nbytes)
        self._registered.append(tensor)

    @contextlib.contextmanager
    def capture(self, zero_copy: bool = True):
        """Wrap ``torch.cuda.graph(...)`` in it whenever the graph holds our
        allreduces. It first waits for this group's earlier calls (a graph
        is captured on its own stream, and the group's calls must not
        overlap on the device). With ``zero_copy`` (the default) the
        allreduces captured inside read the captured tensors directly, and
        leaving exchanges the captured buffers (collective, every rank in
        the same order), so replays may start; without it they are staged
        (one extra copy per replay, nothing to exchange)."""
        if self._in_capture:
            raise UsageError("capture() is already active")
        g = self._group()
        if self._last_stream is not None:
            g.check(self._last_stream)
            self._last_stream = None
        self._in_capture = True
        self._zero_copy = zero_copy
        try:
            yield self
        finally:
            self._in_capture = False
        if zero_copy:
            g.register_captured(self._exchange)

    # ---- errors and recovery ------------------------------------------------
    def poll(self) -> None:
        """Raises an error a kernel has recorded so far, without waiting."""
        self._group().poll()

    def check(self) -> None:
        """Waits for the current stream, then raises an error a kernel
        recorded (``PeerTimeoutError`` names the missing rank)."""
        stream = self._stream()
        self._group().check(stream)
        if self._last_stream == stream:
            self._last_stream = None

    def reset(self, sync: bool = True) -> None:
        """Clears this rank's error and signals after a timeout. Every live
        rank must reset before the next allreduce; ``sync=True`` waits for
        all of them through the group (use ``sync=False`` when a rank is
        dead, and recreate the group without it)."""
        self._group().reset()
        if sync:
            self._exchange(b"reset")

    def close(self) -> None:
        """Frees the group's buffers (after the device is done with them).
        Graphs captured with this group must not be replayed afterwards:
        their kernels name the freed buffers."""
        self._native = None
        self._registered.clear()

    def __repr__(self) -> str:
        return (f"CustomAllreduce({self._native!r}, algorithm={self.algorithm!r}, "
                f"deterministic={self.deterministic!r})")


def torch_empty_like(t):
    import torch

    return torch.empty_like(t, memory_format=torch.contiguous_format)
