"""Growing an elastic job back: horovodrun's host discovery script, polled by ``mpilearn-run``.

The script prints the hosts now available, ``host:slots`` a line (horovodrun's format). The
launcher (not a rank: it outlives every launch) runs it at most every ``interval`` seconds;
when the slots offered (capped at ``--max-np``) exceed the job's ranks, it asks the job to grow
as it asks it to stop: the note file names the target (:func:`note`) and a SIGUSR1 reaches the
ranks, which agree on it in their per-step stop check (no cost on the other steps). Under ULFM
the ranks then spawn the new ones in-process (``MPI_Comm_spawn``, ``train/engine.py``); where
they cannot, they stop at that step boundary with a checkpoint (exit 75) and the launcher
relaunches the job at the new size with ``--resume auto``. Either way the data position
re-shards from events. Rank 0 tells the launcher the job's size after every in-process change
(a growth, a lost rank) in the answer file beside the note (:func:`answer`), so that a job that
lost ranks grows back when the script offers their slots again.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import List, Optional, Tuple

INTERVAL_ENV = "MPILEARN_DISCOVERY_INTERVAL"  # seconds between two runs of the script
ASK = "grow"  # the note's line with the launcher's request: grow RANKS HOSTS


def note(reason: str, ranks: int, hosts: List[Tuple[str, int]]) -> str:
    """The note file's text for a growth: the reason first (the stop line names it), then
    the target the ranks read."""
    return f"{reason}\n{ASK} {ranks} {','.join(f'{h}:{n}' for h, n in hosts)}\n"


def requested(path: Optional[str]) -> Optional[Tuple[int, str]]:
    """(ranks, ``host:slots,...``) that the launcher's note at ``path`` asks the job to grow
    to, or None (another stop, no note, or one this process cannot read)."""
    try:
        with open(path or "") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines[1:]:
        word, _, rest = line.partition(" ")
        ranks, _, hosts = rest.partition(" ")
        if word == ASK and ranks.isdigit():
            return int(ranks), hosts
    return None


def answer_path(note_path: str) -> str:
    """Beside the note, not ``<note>.*`` (the launcher counts those as listening ranks)."""
    return note_path + "-ranks"


def answer(note_path: Optional[str], ranks: int) -> None:
    """Rank 0, after an in-process growth or loss: tell the launcher the job has ``ranks``."""
    if not note_path:  # no launcher's note (plain mpirun)
        return
    try:
        with open(answer_path(note_path), "w") as f:
            f.write(f"{ranks}\n")
    except OSError:  # on another node than the launcher
        pass


def parse_hosts(spec: str) -> List[Tuple[str, int]]:
    """``host1:2,host2`` -> [("host1", 2), ("host2", 1)]."""
    hosts = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, slots = part.partition(":")
        if slots and not slots.isdigit():
            raise ValueError(f"bad host entry {part!r}: expected host or host:slots")
        hosts.append((name, int(slots or 1)))
    return hosts


def discover_hosts(script: str, timeout: float = 60) -> List[Tuple[str, int]]:
    """horovodrun's discovery script: it prints the available hosts, ``host:slots`` a line."""
    try:
        out = subprocess.run([script], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as err:
        raise ValueError(f"--host-discovery-script {script}: {err}") from None
    if out.returncode != 0:
        raise ValueError(f"--host-discovery-script {script} exited {out.returncode}: "
                         f"{out.stderr.strip()[:200]}")
    hosts = [h for line in out.stdout.splitlines() if line.strip()
             for h in parse_hosts(line.strip())]
    if not hosts:
        raise ValueError(f"--host-discovery-script {script} printed no host")
    return hosts


class Growth:
    """What ``launch`` asks between its checks: should the job stop to grow? ``target`` is
    then (ranks, hosts); ``interrupted`` says a person's signal came too (no relaunch)."""

    def __init__(self, script: str, ranks: int, max_ranks: Optional[int],
                 interval: Optional[float] = None):
        self.script, self.ranks, self.max_ranks = script, ranks, max_ranks
        self.interval = float(interval if interval is not None
                              else os.environ.get(INTERVAL_ENV, "5"))
        self.target: Optional[tuple] = None
        self.interrupted = False
        self.started()

    def started(self) -> None:
        """A launch began: the first poll waits one interval; no growth decided yet."""
        self.next_poll = time.monotonic() + self.interval
        self.target = None

    def poll(self) -> Optional[str]:
        """The reason to stop the job now (the note the ranks print), or None."""
        if self.target is not None or time.monotonic() < self.next_poll:
            return None
        self.next_poll = time.monotonic() + self.interval
        try:
            hosts = discover_hosts(self.script, timeout=max(self.interval, 10))
        except ValueError as err:  # a failing script does not end a running job
            sys.stderr.write(f"mpilearn-run: {err}; polling again in {self.interval:g} s\n")
            return None
        slots = sum(n for _, n in hosts)
        ranks = min(slots, self.max_ranks) if self.max_ranks else slots
        if ranks <= self.ranks:
            return None
        self.target = (ranks, hosts)
        return f"the host discovery script ({slots} slots: growing to {ranks} ranks)"

    def grew(self, note_path: str) -> bool:
        """Whether the ranks changed size in process (rank 0's answer beside the note at
        ``note_path``): a growth asked for is then done, and polling goes on from that size."""
        try:
            with open(answer_path(note_path)) as f:
                ranks = f.read().strip()
            os.unlink(answer_path(note_path))
        except OSError:
            return False
        if not ranks.isdigit():
            return False
        self.ranks = int(ranks)
        if self.target is not None:
            self.started()
        return True
