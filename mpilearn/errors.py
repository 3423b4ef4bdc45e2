"""The exceptions mpilearn raises, and the one place that turns them into exit statuses.

Library code raises; only the ``main()`` functions call :func:`exit_status`. The statuses:

=====  =====================================================================================
2      bad input (:class:`UsageError`): one message, from rank 0, before expensive work
3      training cannot usefully continue (:class:`TrainingStopped`): NaN, empty generator,
       a failed data read, a trial past its time limit; the last good state is checkpointed
4      a sweep in which no trial succeeded (:class:`SweepFailed`): its last line names the
       most common failure and where that trial's traceback and output are
75     stopped by a signal (``preempt.Preempted``: SIGTERM, SIGINT, SIGUSR1): checkpointed,
       run again with ``--resume auto`` (``preempt.REQUEUE_EXIT``); a signal before the first
       step (``preempt.StoppedBeforeStart``) saves nothing and says so; an elastic run below
       ``min_ranks`` (checkpointed), or one that lost ranks before its first step
       (:class:`LostBeforeTraining`: nothing to save)
=====  =====================================================================================
"""
from __future__ import annotations

import sys

USAGE_EXIT = 2
STOPPED_EXIT = 3
SWEEP_FAILED_EXIT = 4
# an elastic run's survivors when fewer than min_ranks are left (EX_TEMPFAIL: the same as a
# stop signal's checkpoint, so a requeue script resumes it)
BELOW_MIN_EXIT = 75


class UsageError(Exception):
    """Bad input from the user: reported once by rank 0, exit status 2. Raised alike on every
    rank (the checks run on rank 0 and their verdict is broadcast). ``quiet``: this process
    must not print it (another process already does)."""

    def __init__(self, message: str, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet


class TrainingStopped(Exception):
    """Training cannot usefully continue: a loss or gradient is NaN/inf, the generator only
    emits empty images, or the time limit passed. Raised alike on every rank (decided on
    globally reduced values)."""


class BelowMinRanks(RuntimeError):
    """Fewer ranks than ``train.elastic.min_ranks`` are left; the survivors wrote a checkpoint
    (``core/membership.TooFewRanks`` says which ranks were lost)."""


class LostBeforeTraining(Exception):
    """Ranks were lost where an elastic run has no in-memory state to go back to: in
    start-up, before its first snapshot, or after its last epoch, nothing trained is lost (in
    a stop signal's checkpoint, what followed the newest one is). The survivors exit 75 so
    that a requeue runs the job again (``--resume auto``). ``phase``: where the rank was."""

    phase = "start-up"


class SweepFailed(Exception):
    """A sweep ended with no successful trial (every one failed): the message says why."""


def exit_status(err: BaseException, rank: int = 0) -> int:
    """The exit status for ``err``, after rank 0 printed its one line; an exception that is
    not one of mpilearn's is re-raised with its traceback (the job's abort handler ends every
    rank with it)."""
    from .cluster.preempt import Preempted, StoppedBeforeStart, leave

    if isinstance(err, StoppedBeforeStart):  # (after a start, the Trainer says it, with the path)
        _say(rank, f"mpilearn: {err}")
    if isinstance(err, Preempted):
        return leave()
    if isinstance(err, TrainingStopped):
        _say(rank, f"mpilearn: training stopped: {err}")
        return STOPPED_EXIT
    if isinstance(err, BelowMinRanks):
        _say(rank, f"mpilearn: {err}; continue with --resume auto")
        return BELOW_MIN_EXIT
    if isinstance(err, LostBeforeTraining):
        _say(rank, f"mpilearn: {err}")
        return BELOW_MIN_EXIT
    if isinstance(err, SweepFailed):
        _say(rank, f"mpilearn: sweep failed: {err}")
        return SWEEP_FAILED_EXIT
    if isinstance(err, UsageError):
        if not err.quiet:
            _say(rank, f"mpilearn: error: {err}")
        return USAGE_EXIT
    raise err


def _say(rank: int, line: str) -> None:
    if rank == 0:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
