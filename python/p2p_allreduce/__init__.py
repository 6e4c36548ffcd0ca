"""p2p_allreduce: deterministic allreduce kernels written in Rust, for torch.

``CustomAllreduce`` is shaped like the custom allreduce of SGLang and vLLM:
create it inside an initialised ``torch.distributed`` process group (one
process per GPU), then call ``allreduce(tensor)`` on the current stream.
Results are bit-identical on every rank, for every algorithm and message
size: the rank-order float32 sum, rounded once to the tensor's dtype.
"""

from . import errors
from ._native import __version__, algorithms, driver_present
from .custom_allreduce import CustomAllreduce, DTYPES
from .errors import (
    GroupError,
    P2PAllreduceError,
    PeerTimeoutError,
    PoisonedError,
    UnavailableError,
    UsageError,
)

__all__ = [
    "CustomAllreduce",
    "DTYPES",
    "GroupError",
    "P2PAllreduceError",
    "PeerTimeoutError",
    "PoisonedError",
    "UnavailableError",
    "UsageError",
    "__version__",
    "algorithms",
    "driver_present",
    "errors",
]
