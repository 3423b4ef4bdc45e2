"""Growing an elastic job back: horovodrun's host discovery script, polled by ``mpilearn-run``.

The script prints the hosts now available, ``host:slots`` a line (horovodrun's format). The
launcher (not a rank: it outlives every launch) runs it at most every ``interval`` seconds;
when the slots offered (capped at ``--max-np``) exceed the job's ranks, the job is stopped at a
step boundary like a stop signal (every rank agrees on the step, checkpoints, exits 75) and
relaunched at the new size with ``--resume auto``; the data position re-shards from events.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import List, Optional, Tuple

INTERVAL_ENV = "MPILEARN_DISCOVERY_INTERVAL"  # seconds between two runs of the script


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
