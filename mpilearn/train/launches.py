"""What each launch of a run held its ranks for: per rank, the seconds from its process's start
(the interpreter, imports, MPI, the checks, the build) to its end, with every epoch,
evaluation, checkpoint, the test pass and the export. The epoch records count only the time
inside epochs; this is what an allocation is paid for.

``RUN/launches.jsonl``: one line per launch (a resumed or requeued run adds one), rewritten by
rank 0 after every epoch and at the end, so that a launch killed by ``kill -9`` still counts up
to its last epoch. Each line: ``launch`` (1, 2, ...), ``ranks``, per rank ``devices`` (gpu |
cpu) and ``launched_s``, and ``exit`` (the status; None while it runs, or when it was killed).
"""
from __future__ import annotations

import json
import os
import time
from typing import Optional

from ..core.io import atomic_write_text, read_jsonl
from .callbacks import Callback

FILE = "launches.jsonl"
_IMPORTED = time.monotonic()  # where /proc cannot say when the process started


def process_age() -> float:
    """Seconds since this process started (Linux: its start time in /proc; elsewhere: since
    this module was imported, which misses the interpreter's start and the first imports)."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


class Launches(Callback):
    """Collective to build (every rank's age and device, gathered once); then rank 0 alone
    keeps ``launches.jsonl``: a rank's launched seconds are its age at the gather plus the
    time since (the ranks pass the gather together)."""

    name = "launches"

    def __init__(self, comm, output: str, device: str):
        kind = "gpu" if str(device).startswith("cuda") else "cpu"
        ages = comm.gather((process_age(), kind), root=0)
        self.since = time.monotonic()
        self.rank = comm.Get_rank()
        self.path = os.path.join(output, FILE)
        if self.rank == 0:
            self.ages = [a for a, _ in ages]
            self.devices = [k for _, k in ages]
            self.earlier = read_jsonl(self.path) if os.path.exists(self.path) else []
            self.write(None)

    def write(self, status: Optional[int]) -> None:
        """Rank 0: this launch's line as of now (``status``: its exit status, None: running)."""
        if self.rank != 0:
            return
        now = time.monotonic() - self.since
        line = {"launch": len(self.earlier) + 1, "ranks": len(self.ages),
                "devices": self.devices, "launched_s": [round(a + now, 3) for a in self.ages],
                "exit": status}
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n"
                                             for r in self.earlier + [line]))

    def on_epoch_end(self, record: dict) -> bool:
        self.write(None)
        return False
