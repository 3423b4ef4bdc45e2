"""An epoch's data position: how many events of the epoch's one global order were consumed.

The position is counted in events, not steps, so that any rank count can read the rest of an
epoch exactly once. From position ``p`` with ``size`` ranks of ``local_batch`` events, global
batch ``k`` is ``order[p + k*G : p + (k+1)*G]`` (``G = local_batch * size``) and rank ``r`` reads
its ``r``-th slice. An epoch ends when fewer than ``G`` events are left (those are dropped, as
every epoch drops its incomplete last batch). Pure functions: the loader, the checkpoints and
the elastic recovery (shrink, grow) all use these.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np


def steps_left(n_events: int, position: int, global_batch: int) -> int:
    """Whole global batches left in the epoch from ``position``."""
    return max(0, (n_events - position) // global_batch)


def rank_slice(order: np.ndarray, position: int, rank: int, local_batch: int) -> np.ndarray:
    """Rank ``rank``'s events of the global batch that starts at ``position``."""
    start = position + rank * local_batch
    return order[start:start + local_batch]


def remaining_batches(order: np.ndarray, consumed: int, rank: int, size: int,
                      local_batch: int, steps: Optional[int] = None) -> List[np.ndarray]:
    """This rank's batches for the rest of the epoch: ``order`` is the epoch's global event
    order (``ShardedLoader.order(epoch)``), ``consumed`` the events already trained in it
    (at whatever sizes), ``steps`` an optional cap on the number of global batches."""
    g = local_batch * size
    n = steps_left(len(order), consumed, g)
    if steps is not None:
        n = min(n, steps)
    return [rank_slice(order, consumed + k * g, rank, local_batch) for k in range(n)]


def from_steps(step_in_epoch: int, global_batch: int) -> int:
    """The position of a checkpoint written before positions were kept (one size per run)."""
    return step_in_epoch * global_batch
