"""Graceful stops: SIGTERM / SIGINT / SIGUSR1 -> checkpoint at the next step -> exit 75.

SLURM sends SIGTERM at the time limit and on ``scancel`` (SIGKILL ``KillWait`` seconds later),
or the signal asked for with ``--signal``; ``srun`` and MPICH's ``mpiexec`` forward SIGTERM to
every rank; Open MPI's ``mpirun`` forwards only SIGUSR1/SIGUSR2 and ends the ranks itself on
SIGTERM/SIGINT (SIGKILL 0.5 s later), so ``mpilearn-run`` turns those into a SIGUSR1 and
writes the original signal's name to the file named by :data:`NOTE_ENV`. The handler only
records the signal; the training loop and the HPO coordinator poll :func:`requested` at safe
points (between steps, between trials), agree on it collectively, save, and exit with
:data:`REQUEUE_EXIT`, which the ``jobs/`` scripts turn into ``scontrol requeue``. A second
SIGINT (Ctrl-C twice) raises KeyboardInterrupt: stop now, without a checkpoint.

Start-up: the CLIs install the handler before anything heavy is imported, and each process
then creates ``<note>.<pid>`` beside the note file: ``mpilearn-run`` holds a stop signal back
until every rank has said so (a SIGUSR1 kills a process with no handler). A signal that arrives
before the first step ends the run once start-up is over (:class:`StoppedBeforeStart`).
End: once the run's exit status is decided (done, stopped, bad input), :func:`leave` ignores
further stop signals: one that lands after the last epoch never turns a finished run into 75.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Optional

REQUEUE_EXIT = 75  # EX_TEMPFAIL: "stopped early, run me again with --resume auto"
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
NOTE_ENV = "MPILEARN_SIGNAL_NOTE"  # a file: the signal a launcher wrapper turned into SIGUSR1

_received: Optional[int] = None


class Preempted(Exception):
    """The job was asked to stop (signal); state is saved and the job should be requeued."""


class StoppedBeforeStart(Preempted):
    """A stop signal arrived before the first step: there is nothing to save; run again."""


def _record(signum, frame) -> None:
    global _received
    if signum == signal.SIGINT and _received == signal.SIGINT:
        raise KeyboardInterrupt  # Ctrl-C twice: the user does not want to wait
    if _received is None:
        _received = signum


def install() -> None:
    """Catch SIGTERM, SIGINT and SIGUSR1 (main thread only; a no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        signal.signal(sig, _record)
    note = os.environ.get(NOTE_ENV)
    if note:  # tell mpilearn-run that this process listens (see the module's doc)
        try:
            open(f"{note}.{os.getpid()}", "w").close()
        except OSError:  # another node: the launcher cannot see it and stops waiting in time
            pass


def leave(status: int = REQUEUE_EXIT) -> int:
    """``status``, the run's exit status once it is decided, ignoring further stop signals
    from here on. The run is leaving already; and once the first rank has exited 75, the
    launcher signals the slower ones (``srun --kill-on-bad-exit``, ``mpirun``): a signal that
    came after Python's last steps had put the default handler back killed a rank that was
    exiting 75, and the job read as killed, not stopped. A run that ended on its own (done,
    bad input, stopped by its guard) has nothing left to stop: a SIGINT to ``mpilearn-run``
    during its exit (seconds of interpreter teardown with torch loaded) killed the ranks with
    the forwarded SIGUSR1, and a finished run read as "stopped, requeue me" (75). So SIGTERM
    and SIGUSR1 are ignored, and SIGINT too unless the run stopped on a signal (there Ctrl-C
    keeps its meaning: it ends an exit that hangs)."""
    if threading.current_thread() is threading.main_thread():
        ignored = (signal.SIGTERM, signal.SIGUSR1) + (
            (signal.SIGINT,) if status != REQUEUE_EXIT else ())
        for sig in ignored:
            signal.signal(sig, signal.SIG_IGN)
    return status


def requested() -> Optional[int]:
    """The signal number received so far, or None."""
    return _received


def mask() -> int:
    """This process's stop request as a bit mask (bit = signal number) to OR across ranks."""
    return 1 << _received if _received else 0


def describe(bits: Optional[int] = None) -> str:
    """The stop signal's name: this process's, or the first of ``bits`` (ranks' masks OR-ed).
    A SIGUSR1 that a wrapper forwarded for another signal is named after that one."""
    num = _received if bits is None else next(
        (s for s in SIGNALS if bits & (1 << s)), None)
    if not num:
        return "no signal"
    name = signal.Signals(num).name
    note = os.environ.get(NOTE_ENV)
    if num == signal.SIGUSR1 and note:
        try:
            with open(note) as f:  # its first line (a growth's target follows)
                name = f.readline().strip() or name
        except OSError:  # another node, or no note: the signal is what it was
            pass
    return name


def reset() -> None:
    global _received
    _received = None
