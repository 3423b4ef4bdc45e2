"""How the ranks agree to stop at a step boundary: one 4-byte allreduce after every step (it
is on every step: no pickling). Bit 0: a trial's deadline passed; bit 1: the next batch's
read failed (a DataError); bit N: signal N arrived. Every rank stops at the same step, names
the same signal, and a read failure seen by several ranks becomes one message."""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..core import comm as mcomm
from ..cluster import preempt
from ..data.hdf5 import DataError, one_message
from ..errors import TrainingStopped


def agree(comm, upcoming=None, past_deadline: bool = False,
          signals: bool = True) -> Optional[Exception]:
    """Collective. The exception every rank raises (alike everywhere), or None to go on.
    ``upcoming``: the next batch, or its read's DataError; ``signals=False``: only the read
    is agreed (an epoch's first batch; a stop lands after a step)."""
    MPI = mcomm.mpi()
    failed = isinstance(upcoming, DataError)
    flags = np.array([failed << 1 | (preempt.mask() | int(past_deadline) if signals else 0)],
                     dtype=np.int32)
    comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.BOR)
    if flags[0] & 2:
        seen = comm.allgather(upcoming.where or str(upcoming) if failed else None)
        return TrainingStopped(one_message([(r, w) for r, w in enumerate(seen) if w])
                               + "; replace the file, or set data.on_error=skip to train "
                               "without those events, and continue with --resume")
    if flags[0] & ~3:
        return preempt.Preempted(f"stopped by {preempt.describe(int(flags[0]))}")
    if flags[0] & 1:
        return TrainingStopped("the trial ran past its time limit")
    return None


def before_start(comm) -> None:
    """Collective, once start-up is over (imports, MPI, checks, construction): a stop signal
    that arrived during it, on any rank, ends the run here on every rank."""
    bits = comm.allreduce(preempt.mask(), op=mcomm.mpi().BOR)
    if bits:
        raise preempt.StoppedBeforeStart(f"stopped by {preempt.describe(bits)} before the "
                                         "first step; nothing to save; run again with "
                                         "--resume auto")
