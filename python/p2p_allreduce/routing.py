"""Who takes an allreduce: our kernels or the engine's NCCL, by the table
``p2p-allreduce tune`` measured on this machine, and the mode.

Pure functions of (table, size, mode), no torch and no GPU, so that every
rank of a group (same table: the group checks it at setup) gives the same
answer for the same tensor, and so that they are tested without a GPU.

The table is a list of bands ``(up_to, winner, margin)`` as the native
group's ``nccl_bands`` gives them: messages of at most ``up_to`` bytes
(``None``: no limit) and more than the previous band's are won by
``winner`` ("ours", "nccl" or "nccl_symmetric") by ``margin`` (how much
slower the next best was, a fraction; ``None``: not measured).

Modes:

- **fastest** (the default): a size the table gives to NCCL goes to NCCL
  (``CustomAllreduce.should_use`` says no, so the engine's own NCCL path
  takes it). Bits: ours where we run (the rank-order float32 sum, rounded
  once: the same on every rank and for every size, batch and algorithm);
  NCCL's where NCCL runs (they depend on its algorithm, protocol, channels
  and world size, so a size that crosses into an NCCL band may change
  bits).
- **deterministic** (``deterministic=True`` or
  ``P2P_ALLREDUCE_DETERMINISTIC=1``): every size up to ``max_size`` on our
  kernels, whatever the table says: our bits everywhere, possibly slower
  where NCCL measured faster.
"""

import os
from typing import Iterable, Mapping, Optional, Sequence, Tuple

OURS = "ours"
NCCL = "nccl"
NCCL_SYMMETRIC = "nccl_symmetric"
BACKENDS = (OURS, NCCL, NCCL_SYMMETRIC)

#: The environment variable that turns deterministic mode on.
ENV_DETERMINISTIC = "P2P_ALLREDUCE_DETERMINISTIC"

Band = Tuple[Optional[int], str, Optional[float]]


def deterministic_from_env(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``P2P_ALLREDUCE_DETERMINISTIC`` asks for deterministic mode
    (``1``, ``true``, ``yes``, ``on``; anything else, or unset: no)."""
    env = os.environ if environ is None else environ
    return env.get(ENV_DETERMINISTIC, "").strip().lower() in ("1", "true", "yes", "on")


def check_bands(bands: Sequence[Band]) -> None:
    """Raises ValueError unless ``bands`` is a table: limits strictly
    increasing, the last ``None``, winners known."""
    if not bands:
        raise ValueError("no bands: give at least one, the last with up_to None")
    last = -1
    for i, (up_to, winner, _margin) in enumerate(bands):
        if winner not in BACKENDS:
            raise ValueError(f"band {i}: winner {winner!r} is not one of {BACKENDS}")
        if up_to is None:
            if i != len(bands) - 1:
                raise ValueError(f"band {i}: only the last band may have no limit")
            return
        if up_to <= last:
            raise ValueError(f"band {i}: limits must increase ({last} then {up_to})")
        last = up_to
    raise ValueError("the last band must have no limit (up_to None)")


def winner(bands: Iterable[Band], nbytes: int) -> str:
    """The backend the table measured fastest for a message of ``nbytes``."""
    for up_to, who, _margin in bands:
        if up_to is None or nbytes <= up_to:
            return who
    return OURS


def route(bands: Iterable[Band], nbytes: int, deterministic: bool) -> str:
    """Who runs a message of ``nbytes`` bytes: "ours" in deterministic mode,
    else the table's winner."""
    return OURS if deterministic else winner(bands, nbytes)
