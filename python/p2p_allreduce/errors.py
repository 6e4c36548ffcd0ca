"""Exceptions raised by p2p_allreduce (the Rust errors, sorted by what to do)."""

from typing import Optional, Sequence


class P2PAllreduceError(RuntimeError):
    """Base class of every error p2p_allreduce raises."""

    def __init__(self, message: str, **fields):
        super().__init__(message)
        for name, value in fields.items():
            setattr(self, name, value)


class PeerTimeoutError(P2PAllreduceError):
    """A peer did not arrive within the group's timeout (dead, late, or it
    ran a different collective). ``peers`` names the missing ranks; for a
    kernel timeout ``barrier`` names the barrier and ``rank`` the rank that
    waited. The group is out of step: ``reset()`` it on every live rank, or
    recreate it without the dead rank."""

    rank: Optional[int] = None
    peers: Sequence[int] = ()
    barrier: Optional[str] = None


class PoisonedError(P2PAllreduceError):
    """An earlier error left the group unusable until ``reset()``."""


class UsageError(P2PAllreduceError, ValueError):
    """A call the library refuses (sizes, alignment, registration, config):
    the message says what to change."""


class GroupError(P2PAllreduceError):
    """The ranks disagree (settings, dtype or count of a call, captures)."""


class UnavailableError(P2PAllreduceError):
    """This group cannot use p2p-allreduce: no CUDA driver, no kernels built
    for this GPU, or ranks on more than one host (CUDA IPC works within one
    host; ``peers`` names a rank on another host). Fall back to NCCL."""

    peers: Sequence[int] = ()
