"""A bound on every wait inside training: a rank that makes no progress for
max(floor, factor x its median step) is stuck (in I/O on a parallel file system, in a
collective whose peer is gone, in a device call). A thread notices it, writes every thread's
Python stack (faulthandler) into the run directory, prints one line naming the rank, its host
and where its main thread was, and ends the job (MPI_Abort; one process: ``os._exit``).

Progress is a ``beat()`` after each step (a clock read and an append: the per-step cost).
A rank whose main thread waits in a collective is most likely waiting for the stuck one, so
it gives that rank ``grace`` more seconds to be the one that speaks: the line names the cause,
not the ranks that waited for it. Configured by ``train.watchdog`` (``core/config.py``).
"""
from __future__ import annotations

import collections
import contextlib
import faulthandler
import os
import socket
import statistics
import sys
import threading
import time
from typing import Callable, Optional

WATCHDOG_EXIT = 124  # as timeout(1): the job ran past a bound; a batch script retries it

# where a main thread that waits for its peers spends its time (Python frames only: the MPI
# call itself is C, so the innermost Python frame is its caller)
COLLECTIVE_FILES = (os.sep + os.path.join("mpilearn", "allreduce") + os.sep,
                    os.path.join("mpilearn", "train", "stops.py"),
                    os.path.join("mpilearn", "core", "comm.py"),
                    os.path.join("mpilearn", "core", "membership.py"),
                    os.path.join("torch", "distributed") + os.sep, "mpi4py")


def stack_file(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"watchdog-rank{rank}.txt")


class Watchdog:
    """``start()`` the thread once; ``arm()`` where steps begin, ``beat()`` after each,
    ``pause()`` where work of another kind (validation, plots) takes over; ``stop()`` at the
    end. ``on_stuck(line)`` ends the job (default: :func:`end_job`)."""

    KEEP = 101  # step times the median is taken over (the recent ones)

    def __init__(self, rank: int, run_dir: str, floor_s: float = 60.0, factor: float = 10.0,
                 on_stuck: Optional[Callable[[str], None]] = None):
        self.rank, self.run_dir = rank, run_dir
        self.floor_s, self.factor = float(floor_s), float(factor)
        self.on_stuck = on_stuck or end_job
        self.steps = collections.deque(maxlen=self.KEEP)
        self.last = time.monotonic()
        self.armed = False
        self.patient = False  # watching a start-up's kind of work: factor x floor
        self._done = threading.Event()
        self._main = threading.main_thread().ident
        self._thread: Optional[threading.Thread] = None

    # -- the training loop's side: as cheap as possible ---------------------------------
    def beat(self) -> None:
        now = time.monotonic()
        self.steps.append(now - self.last)  # the first one after arm() includes a read
        self.last = now

    def arm(self) -> None:
        self.last = time.monotonic()
        self.armed = True

    def pause(self) -> None:
        self.armed = False

    def start(self) -> "Watchdog":
        self._thread = threading.Thread(target=self._watch, name="mpilearn-watchdog",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()

    # -- the thread's side ----------------------------------------------------------------
    def limit(self) -> float:
        """Seconds without a beat that mean stuck. Before the first step is measured, and while
        ``patient`` (:func:`watching`), factor x floor: a first step also compiles
        (torch.compile) and warms the caches up."""
        steps = list(self.steps)
        return max(self.floor_s, self.factor * statistics.median(steps)) \
            if steps and not self.patient else self.factor * self.floor_s

    def grace(self, limit: float) -> float:
        return max(1.0, 0.5 * limit)

    def _watch(self) -> None:
        poll = min(1.0, self.floor_s / 6)
        while not self._done.wait(poll):
            if not self.armed:
                continue
            idle = time.monotonic() - self.last
            limit = self.limit()
            if idle <= limit:
                continue
            frame = sys._current_frames().get(self._main)
            waiting = frame is not None and in_collective(frame)
            if waiting and idle <= limit + self.grace(limit):
                continue
            self._fire(idle, limit, frame, waiting)
            return

    def _fire(self, idle: float, limit: float, frame, waiting: bool) -> None:
        path = stack_file(self.run_dir, self.rank)
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            with open(path, "w") as f:
                f.write(f"rank {self.rank} on {socket.gethostname()}: no progress for "
                        f"{idle:.0f} s (limit {limit:.0f} s)\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
        except OSError as err:
            path = f"(not written: {err})"
        kind = "waiting in a collective" if waiting else "stuck"
        line = (f"mpilearn: watchdog: rank {self.rank} on {socket.gethostname()} made no "
                f"progress for {idle:.0f} s (limit {limit:.0f} s): {kind} at "
                f"{where(frame)}; every thread's stack in {path}; ending the job")
        self.on_stuck(line)


def in_collective(frame) -> bool:
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in COLLECTIVE_FILES):
            return True
        frame = frame.f_back
    return False


def where(frame) -> str:
    """The main thread's innermost Python frame, as ``function (file:line)``."""
    if frame is None:
        return "an unknown place"
    code = frame.f_code
    return f"{code.co_name} ({code.co_filename}:{frame.f_lineno})"


def end_job(line: str) -> None:
    """One line, then the job ends: every rank of the job (MPI_Abort), or this process."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except OSError:
        pass
    if "mpi4py.MPI" in sys.modules:
        from . import comm, membership

        # the job's communicator: one that grew from a single rank has a world of one
        elastic = membership.current()
        job = elastic.comm if elastic is not None else sys.modules["mpi4py.MPI"].COMM_WORLD
        if job.Get_size() > 1:
            # recorded for mpilearn-run: Open MPI 5 under --with-ft ulfm was seen not to end a
            # grown job after this abort; mpilearn-run ends it ABORT_GRACE seconds later
            comm.abort(job, WATCHDOG_EXIT, "watchdog: no progress")
    os._exit(WATCHDOG_EXIT)


@contextlib.contextmanager
def watching(dog: Optional[Watchdog]):
    """The block is watched with a start-up's patience (factor x floor: a spawned rank starts
    Python, MPI and torch; a slow spawn that fails still ends as it did); ``dog`` None: not
    watched."""
    if dog is not None:
        dog.patient = True
        dog.arm()
    try:
        yield
    finally:
        if dog is not None:
            dog.pause()
            dog.patient = False


def from_config(train: dict, rank: int, run_dir: str) -> Optional[Watchdog]:
    """The configured watchdog (``train.watchdog``), not started; None when it is off."""
    cfg = train["watchdog"]
    if not cfg["enabled"]:
        return None
    return Watchdog(rank, run_dir, cfg["floor_s"], cfg["factor"])
