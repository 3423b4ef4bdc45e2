"""Graceful stops at a batch system's time limit: SIGTERM / SIGUSR1 -> checkpoint -> exit 75.

SLURM sends SIGTERM at the time limit (and SIGKILL ``KillWait`` seconds later), or the signal
asked for with ``--signal``; ``mpirun`` forwards SIGUSR1 to every rank. The handler only
records the signal; the training loop and the HPO coordinator poll :func:`requested` at
safe points (between steps, between trials), agree on it collectively, save, and exit with
:data:`REQUEUE_EXIT`, which the ``jobs/`` scripts turn into ``scontrol requeue``.
"""
from __future__ import annotations

import signal
import threading
from typing import Optional

REQUEUE_EXIT = 75  # EX_TEMPFAIL: "stopped early, run me again with --resume auto"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_received: Optional[int] = None


class Preempted(Exception):
    """The job was asked to stop (signal); state is saved and the job should be requeued."""


def _record(signum, frame) -> None:
    global _received
    _received = signum


def install() -> None:
    """Catch SIGTERM and SIGUSR1 (main thread only; a no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        signal.signal(sig, _record)


def requested() -> Optional[int]:
    """The signal number received so far, or None."""
    return _received


def describe() -> str:
    return signal.Signals(_received).name if _received else "no signal"


def reset() -> None:
    global _received
    _received = None
