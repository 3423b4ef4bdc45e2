"""Why a job ended, in one line: the rank that failed first, its host, and how it ended (a
signal, an exit status, the kernel's OOM killer where the system says so), never a signal
that was only the consequence (the SIGTERM a launcher sends the survivors).

The launcher knows: Open MPI's ``prterun`` and ``srun`` print the first failed rank. Their
stderr passes through :class:`Scanner` unchanged (byte for byte, as it comes) and is read on
the way; the OOM evidence is the memory cgroup's ``oom_kill`` counter, before and after.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import threading
from typing import Callable, Optional

# prterun noticed that process rank 1 with PID 1822 on node vm exited on signal 9 (Killed).
PRTE_SIGNAL = re.compile(r"process rank (\d+) with PID (\d+) on node (\S+) exited on\s+"
                         r"signal (\d+)")
# prterun detected that one or more processes exited with non-zero status ... Process name:
# [prterun-vm-1822@1,1]  Exit code: 1  (the rank after the comma)
PRTE_EXIT = re.compile(r"Process name:\s+\[\S+?,(\d+)\]\s+Exit code:\s+(\d+)")
# srun: error: node1: task 1: Killed / srun: error: node1: task 1: Exited with exit code 3
SRUN = re.compile(r"srun: error: (\S+): tasks? (\d+)(?:-\d+)?: (Killed|Exited with exit code "
                  r"(\d+)|[A-Z][A-Za-z ]+)")

# a rank's own report (Open MPI's signal handler), printed as it crashes, where the launcher
# prints nothing yet (--with-ft ulfm): [vm:08244] Signal: Segmentation fault (11)
CRASH = re.compile(r"\[([^:\]\s]+):0*(\d+)\] Signal: [^(\n]+\((\d+)\)")

OOM_FILES = ("/sys/fs/cgroup/memory.events",              # cgroup v2
             "/sys/fs/cgroup/memory/memory.oom_control")  # cgroup v1


def oom_kills() -> Optional[int]:
    """The memory cgroup's OOM-kill count, or None where it cannot be read."""
    paths = list(OOM_FILES)
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    paths.insert(0, f"/sys/fs/cgroup{path}/memory.events")
                elif "memory" in controllers.split(","):
                    paths.insert(0, f"/sys/fs/cgroup/memory{path}/memory.oom_control")
    except OSError:
        pass
    for path in paths:
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def first_failure(text: str) -> Optional[str]:
    """'rank R on host H (pid P): killed by SIGKILL' (or 'exited with status N'), from the
    launcher's own report; None if it has none."""
    found = PRTE_SIGNAL.search(text)
    if found:
        rank, pid, host, num = found.groups()
        return f"rank {rank} on host {host} (pid {pid}): killed by {signal_name(int(num))}"
    found = PRTE_EXIT.search(text)
    if found:
        return f"rank {found.group(1)}: exited with status {found.group(2)}"
    found = SRUN.search(text)
    if found:
        host, rank, how, code = found.groups()
        how = f"exited with status {code}" if code else \
            ("killed by SIGKILL" if how == "Killed" else how.strip().lower())
        return f"rank {rank} on host {host}: {how}"
    return None


def crashed(text: str) -> Optional[str]:
    """'rank R on host H (pid P): killed by SIGSEGV' from the launcher's report, else
    'pid P on host H: killed by SIGSEGV' from the first crash a rank reported itself; None
    where neither is there."""
    if PRTE_SIGNAL.search(text):
        return first_failure(text)
    found = CRASH.search(text)
    if found:
        host, pid, num = found.groups()
        return f"pid {pid} on host {host}: killed by {signal_name(int(num))}"
    return None


def describe(text: str, rc: int, oom_before: Optional[int], oom_after: Optional[int],
             during: Optional[Callable[[int], Optional[str]]] = None, ranks: int = 2) -> str:
    """The one line for a job of ``ranks`` ranks that ended with status ``rc`` (not 0, 2 or
    75); ``during(rank)``: the start-up phase the failed rank was in, where it was starting."""
    who = first_failure(text)
    oom = oom_before is not None and oom_after is not None and oom_after > oom_before
    rank = re.match(r"rank (\d+)", who or "")
    phase = during(int(rank.group(1))) if rank and during is not None else None
    parts = [(who or f"the launcher exited with status {rc}") +
             (f", during start-up ({phase})" if phase else "")]
    if oom:
        parts.append(f"the kernel's OOM killer ended {oom_after - oom_before} process(es) "
                     "here (memory cgroup oom_kill)")
    elif rc == 128 + signal.SIGKILL and (who is None or "SIGKILL" in who):
        parts.append("no OOM kill recorded where this machine can see (the memory cgroup; "
                     "another node's is not)" if oom_after is not None else
                     "SIGKILL: the OOM killer, a kill -9, or a scheduler's kill")
    others = "; the other ranks were stopped because of it" if ranks > 1 else ""
    return "mpilearn-run: the job ended: " + "; ".join(parts) + others


class Scanner:
    """Copies a launcher's stderr through, keeping its last 64 KiB to read the cause from."""

    KEEP = 1 << 16

    def __init__(self, fd: int, out=None):
        self.fd, self.out = fd, out or sys.stderr.buffer
        self.tail = b""
        self.thread = threading.Thread(target=self._copy, name="mpilearn-run-stderr", daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            try:
                self.out.write(chunk)
                self.out.flush()
            except (OSError, ValueError):
                pass
            self.tail = (self.tail + chunk)[-self.KEEP:]
        os.close(self.fd)

    def text(self, wait: float = 5.0) -> str:
        self.thread.join(wait)
        return self.tail.decode("utf-8", "replace")
