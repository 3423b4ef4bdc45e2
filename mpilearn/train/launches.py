"""What each launch of a run held its ranks for: per rank, the seconds from its process's start
(the interpreter, imports, MPI, the checks, the build) to its end, with every epoch,
evaluation, checkpoint, the test pass and the export. The epoch records count only the time
inside epochs; this is what an allocation is paid for.

``RUN/launches.jsonl``: one line per launch (a resumed or requeued run adds one), rewritten by
rank 0 after every epoch and at the end, so that a launch killed by ``kill -9`` still counts up
to its last epoch. Each line: ``launch`` (1, 2, ...), ``ranks`` (at its start), per process
``devices`` (gpu | cpu) and ``launched_s``, and ``exit`` (the status; None while it runs, or
when it was killed). An elastic launch's processes are every one it had: those it started
with, then the ones it spawned (``spawned``: their indexes); a lost one (``lost``: their
indexes) is charged to its loss, not to the end; ``ranks_at_end`` is the size it ended on.
Every rank keeps the record, so the survivors go on writing it after rank 0 is lost.
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
    """Collective to build (every rank's age, device and clock, gathered by all); then
    whichever rank is rank 0 keeps ``launches.jsonl``: a process's launched seconds are its age
    at the gather plus the time since, up to its end. :meth:`on_membership` follows an elastic
    change on every rank of the new communicator (a loss without any message)."""

    name = "launches"

    def __init__(self, comm, output: Optional[str], device: str):
        """``output`` None: a spawned process's record, which :meth:`on_membership` fills."""
        self.kind = "gpu" if str(device).startswith("cuda") else "cpu"
        self.rank, self.path = comm.Get_rank(), None
        self.earlier = None  # the earlier launches' lines, read by the rank that writes
        if output is None:
            return
        ages = comm.allgather((process_age(), self.kind, time.time()))
        self.since = max(t for _, _, t in ages)  # the same on every rank
        self.path = os.path.join(output, FILE)
        # per process: its age at ``since``, its device, its end after ``since`` (None: on)
        self.ages = [a + self.since - t for a, _, t in ages]
        self.devices = [k for _, k, _ in ages]
        self.ended = [None] * len(ages)
        self.spawned, self.ranks = [], len(ages)
        self.current = list(range(len(ages)))  # the process index of each current rank
        self.write(None)

    def _earlier(self) -> list:
        """The lines of the run's earlier launches: read once, by the rank that writes (after
        a loss of rank 0, the new one: the file then holds this launch's line too)."""
        if not os.path.exists(self.path):
            return []
        return [r for r in read_jsonl(self.path) if r.get("started") != round(self.since, 3)]

    def on_membership(self, comm, change) -> None:
        """Collective over the new communicator after an elastic change (``core.membership``
        ``Change``): a lost process ends at its loss; a spawned one joins with its own age.
        The new rank 0's record goes to the spawned processes, which have none yet."""
        if change.added:  # a growth: two small collectives (every rank agreed on the change)
            newcomer = self.path is None
            state = comm.bcast(self.state() if comm.Get_rank() == 0 else None, root=0)
            if newcomer:
                self.__dict__.update(state)
            joined = comm.allgather((process_age() - (time.time() - self.since), self.kind)
                                    if newcomer else None)
            for age, kind in filter(None, joined):  # in rank order: the spawned come last
                self.ages.append(age)
                self.devices.append(kind)
                self.ended.append(None)
                self.spawned.append(len(self.ages) - 1)
                self.current.append(len(self.ages) - 1)
        else:  # a loss: every survivor holds the record already, nothing to exchange
            lost = {r for r, _ in change.lost}
            for r in lost:
                self.ended[self.current[r]] = change.detected - self.since
            self.current = [p for r, p in enumerate(self.current) if r not in lost]
        self.rank = comm.Get_rank()
        self.write(None)

    def state(self) -> dict:
        return {k: getattr(self, k) for k in ("since", "path", "ages", "devices", "ended",
                                              "spawned", "ranks", "current")}

    def write(self, status: Optional[int]) -> None:
        """Rank 0: this launch's line as of now (``status``: its exit status, None: running)."""
        if self.rank != 0 or self.path is None:
            return
        if self.earlier is None:
            self.earlier = self._earlier()
        now = time.time() - self.since
        line = {"launch": len(self.earlier) + 1, "started": round(self.since, 3),
                "ranks": self.ranks, "devices": self.devices,
                "launched_s": [round(a + (now if end is None else end), 3)
                               for a, end in zip(self.ages, self.ended)],
                "exit": status}
        lost = [i for i, end in enumerate(self.ended) if end is not None]
        if lost or self.spawned:
            line.update(lost=lost, spawned=self.spawned, ranks_at_end=len(self.current))
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n"
                                             for r in self.earlier + [line]))

    def on_epoch_end(self, record: dict) -> bool:
        self.write(None)
        return False
