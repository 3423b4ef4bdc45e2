"""One writer per run directory: a lock file that works on parallel file systems.

``fcntl`` locks are unreliable on NFS, Lustre and GPFS, so the lock is a file created with
``O_EXCL`` (atomic there too) that names its holder (host, PID, SLURM job or MPIJob, start
time), and whose modification time the holder refreshes every :data:`HEARTBEAT` seconds from
a background thread. A second job finds the file and is refused (bad input, exit 2) with one
message naming the holder, unless the holder is gone:

- the same SLURM job (a requeued job keeps its id) or MPIJob takes its own lock back;
- a holder on this host whose process no longer exists, or whose SLURM job (on this cluster)
  has ended, is gone;
- otherwise a holder whose heartbeat is older than :func:`stale_after` and whose SLURM job is
  not known to run is gone.

A lock taken over says so in one line. ``--force-unlock`` removes any lock, naming it.
"""
from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import uuid
from typing import Optional

from ..errors import UsageError

NAME = ".mpilearn.lock"
HEARTBEAT_ENV = "MPILEARN_LOCK_HEARTBEAT"  # seconds between refreshes (default 30)


def heartbeat() -> float:
    return float(os.environ.get(HEARTBEAT_ENV) or 30)


def stale_after() -> float:
    """A heartbeat this old means the holder stopped refreshing it (missed four beats)."""
    return 4 * heartbeat()


def mpijob_name() -> str:
    """The Kubeflow MPIJob this process belongs to (its pods are <name>-launcher, <name>-worker-N)."""
    if not os.environ.get("K_MPI_JOB_ROLE"):
        return ""
    return re.sub(r"-(launcher|worker)(-[\w-]*)?$", "", socket.gethostname())


def identity() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "slurm_job": os.environ.get("SLURM_JOB_ID", ""),
            "slurm_cluster": os.environ.get("SLURM_CLUSTER_NAME", ""),
            "mpijob": mpijob_name(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "token": uuid.uuid4().hex}


def describe(holder: dict, age: Optional[float] = None) -> str:
    job = (f"SLURM job {holder['slurm_job']}" if holder.get("slurm_job")
           else f"MPIJob {holder['mpijob']}" if holder.get("mpijob") else "no batch job")
    beat = f", heartbeat {age:.0f} s ago" if age is not None else ""
    return (f"host {holder.get('host', '?')}, PID {holder.get('pid', '?')}, {job}, "
            f"started {holder.get('started', '?')}{beat}")


def _read(path: str):
    """(holder, heartbeat age in s), or (None, None) when there is no lock file. A file being
    written this instant (empty) is a fresh holder of unknown identity."""
    try:
        with open(path) as f:
            text = f.read()
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return None, None
    try:
        holder = json.loads(text)
    except ValueError:
        holder = {}
    return holder, age


def pid_alive(pid) -> bool:
    """A zombie is not alive: a rank killed by its launcher (MPICH's Hydra, after an MPI_Abort)
    stays one until PID 1 reaps it, seconds later in a container, and its lock would refuse
    the relaunch as a second writer."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError):
        return True
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # gone meanwhile
        return False
    except (OSError, IndexError):  # no /proc (not Linux): as kill said
        return True
    return state != "Z"


def why_gone(holder: dict, age: float, me: dict) -> Optional[str]:
    """Why ``holder`` no longer writes (the reason to take its lock), or None: it may."""
    from ..cluster import slurmjob

    if holder.get("slurm_job") and holder.get("slurm_job") == me["slurm_job"] \
            and holder.get("slurm_cluster", "") == me["slurm_cluster"]:
        return f"this is the same SLURM job {me['slurm_job']}, requeued"
    if holder.get("mpijob") and holder["mpijob"] == me["mpijob"]:
        return f"this is the same MPIJob {me['mpijob']}, restarted"
    same_host = holder.get("host") == me["host"]
    job_runs = None
    if holder.get("slurm_job") and holder.get("slurm_cluster", "") == me["slurm_cluster"]:
        job_runs = slurmjob.running(holder["slurm_job"])
        if job_runs is False:
            return f"its SLURM job {holder['slurm_job']} no longer runs"
    if same_host and holder.get("pid") is not None:
        if not pid_alive(holder["pid"]):
            return f"its process {holder['pid']} on {me['host']} is gone"
        return None  # alive here: maybe hung, but alive (--force-unlock)
    if age > stale_after() and not job_runs:
        return f"its heartbeat stopped {age:.0f} s ago"
    return None


class RunLock:
    """The lock on one path, held by this process (rank 0) until :meth:`release`."""

    def __init__(self, path: str, target: str, made_folder: bool = False):
        self.path, self.target, self.me = path, target, identity()
        self.made_folder = made_folder  # the run directory did not exist before the lock
        self._stop = threading.Event()
        self._thread = None

    def acquire(self, force: bool = False) -> list:
        """Take the lock; returns the notes to print (a takeover, a forced unlock). Raises
        UsageError naming the holder when another job writes here."""
        notes = []
        for _ in range(5):  # a holder that releases or is replaced meanwhile: look again
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder, age = _read(self.path)
                if holder is None:
                    continue
                if force:
                    reason = "--force-unlock"
                    notes.append(f"mpilearn: --force-unlock: removed the lock {self.path} of "
                                 f"{describe(holder, age)}")
                else:
                    reason = why_gone(holder, age, self.me)
                    if reason is None:
                        raise UsageError(self._refusal(holder, age))
                    if not reason.startswith("this is the same"):
                        notes.append(f"mpilearn: took over the lock {self.path} of "
                                     f"{describe(holder, age)}: {reason}")
                self._remove_if(holder)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.me, f)
            self._start_heartbeat()
            return notes
        raise UsageError(f"{self.path}: the lock keeps changing hands; another job is "
                         "starting in this run directory")

    def _refusal(self, holder: dict, age: float) -> str:
        job = holder.get("slurm_job")
        how = (f"wait for it to end, or stop it (scancel {job})" if job
               else f"wait for it to end, or stop it (kubectl delete mpijob {holder['mpijob']})"
               if holder.get("mpijob") else "wait for it to end, or stop it")
        return (f"{self.target} is being written by another job "
                f"({describe(holder, age)}; lock {self.path}): {how}, or choose another "
                "--output; if that job is surely gone, add --force-unlock")

    def _remove_if(self, holder: dict) -> None:
        """Remove the lock file if it is still ``holder``'s (not a newer taker's)."""
        aside = f"{self.path}.gone-{self.me['token']}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        now, _ = _read(aside)
        if now is not None and now.get("token") != holder.get("token"):
            try:
                os.link(aside, self.path)  # someone else's fresh lock: put it back
            except FileExistsError:
                pass
        os.unlink(aside)

    def _start_heartbeat(self) -> None:
        def beat():
            while not self._stop.wait(heartbeat()):
                holder, _ = _read(self.path)
                if holder is None or holder.get("token") != self.me["token"]:
                    return  # unlocked by force: not ours to refresh
                try:
                    os.utime(self.path)
                except OSError:
                    pass

        self._thread = threading.Thread(target=beat, name="mpilearn-lock-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        holder, _ = _read(self.path)
        if holder is not None and holder.get("token") == self.me["token"]:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            if self.made_folder:  # a run that wrote nothing (bad input) leaves no folder
                try:
                    os.rmdir(os.path.dirname(self.path))
                except OSError:  # not empty: the run wrote there
                    pass


def hold(comm, path: str, force: bool = False, single_file: bool = False) -> Optional[RunLock]:
    """Collective: rank 0 takes the lock on ``path``, a run directory (created if missing), or
    with ``single_file`` an output file (the lock is ``<path>.lock``), and prints its notes; a
    refusal is bad input on every rank. The lock goes when the process exits (or on
    ``release()`` of the lock returned on rank 0)."""
    import atexit

    from .comm import check_on_root

    def take():
        made = False
        if single_file:
            lock_path = f"{path}.lock"
        else:
            made = not os.path.exists(path)
            os.makedirs(path, exist_ok=True)
            lock_path = os.path.join(path, NAME)
        lock = RunLock(lock_path, path, made_folder=made)
        for note in lock.acquire(force):
            print(note, flush=True)
        atexit.register(lock.release)
        return lock

    return check_on_root(comm, take)
