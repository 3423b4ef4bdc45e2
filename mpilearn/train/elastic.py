"""Elastic training, the driver's side: in-memory snapshots of a step's state, and what the
survivors of a lost rank do before they go on (``mpilearn.core.membership`` finds the loss and
rebuilds the communicator).

A snapshot is taken after every ``snapshot_every`` steps: deep copies of the task's models and
optimizers (loss scaling and the GAN's step counters are in its state), the position, this
rank's running sums, its random streams and the callbacks' state. The last two are kept: in a
synchronous step some survivors may have applied the step in flight and others not, so the
survivors agree on the smallest newest snapshot and every one of them holds it. A step that
ends an epoch has two: the state before the epoch's end and the one after it (:func:`order`).
Local SGD's snapshots are taken at its averages only (``LocalSGD.snapshot_every``), where every
rank holds the same model; downpour and EASGD (asynchronous: no common step) are refused.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import List, Optional

from ..errors import UsageError

ELASTIC_ALGORITHMS = ("allreduce", "local_sgd")


def settings(config: dict) -> Optional[dict]:
    """``train.elastic`` when it asks for elastic training (min_ranks > 0), else None."""
    e = config["train"].get("elastic") or {}
    return e if int(e.get("min_ranks") or 0) > 0 else None


def join(ctx, config: dict) -> None:
    """The job's membership, made before start-up where the run is elastic, so that a rank
    lost during start-up is named (rank and host) and ends the job with exit 75 on every
    survivor (:func:`outside_training`) instead of a traceback from each. Start-up itself is
    not retried: it holds no trained state, and a relaunch reads the same checkpoint.

    Under ULFM ``train``'s main made one right after ``MPI_Init`` (``Membership.early``: the
    config was not read yet); here it gets its bounds and hosts, or, for a run that is not
    elastic, it is dropped (a loss from here ends the job as in any run)."""
    from ..core import membership

    e = settings(config)
    m = membership.current()
    if e is not None and config["train"]["backend"] == "mpi" and membership.supported():
        if m is not None and m.comm is ctx.comm:
            m.min_ranks, m.max_ranks = int(e["min_ranks"]), int(e.get("max_ranks") or 0)
            if None in m.hosts:
                m.gather_hosts()
        else:
            membership.Membership.for_context(ctx, int(e["min_ranks"]),
                                              int(e.get("max_ranks") or 0))
    elif m is not None:
        membership.set_current(None)


def outside_training(err: BaseException) -> BaseException:
    """``err`` as the job ends with it: a lost rank outside the training loop (start-up, or
    after the last epoch) becomes one line and exit 75 (``membership.outside_training``); one
    in start-up is noted for ``mpilearn-run``, which relaunches such a job."""
    from ..core import membership

    m = membership.current()
    if m is None:
        return err
    err = membership.outside_training(m, err)
    # a start-up loss asks mpilearn-run (ULFM mode) to run the job again; one in a stop's
    # checkpoint or after the last epoch does not (the stop, or the finished run, stands)
    if isinstance(err, membership.LostBeforeTraining) and err.phase.startswith("start-up") \
            and m.rank == 0:
        from ..core import comm as mcomm

        mcomm.record_relaunch(str(err).split(";")[0])
    return err


def check(config: dict, size: int) -> None:
    """Bad input (UsageError) for what elastic training cannot do (yet): said before any step."""
    from ..core import membership

    e = settings(config)
    if e is None:
        return
    t = config["train"]
    if t["algorithm"] not in ELASTIC_ALGORITHMS:
        raise UsageError(f"train.elastic: train.algorithm={t['algorithm']} is asynchronous and "
                         "not elastic: its workers share no step that a snapshot could hold, "
                         "and rank 0 is its master (a lost rank would end the run); use "
                         "train.algorithm=allreduce or local_sgd, or leave out "
                         "train.elastic.min_ranks")
    if t["backend"] != "mpi":
        raise UsageError(f"train.elastic needs train.backend=mpi (ULFM), not {t['backend']}")
    if int(e["min_ranks"]) > size:
        raise UsageError(f"train.elastic.min_ranks={e['min_ranks']} is more than the {size} "
                         "rank(s) this job started with")
    if not membership.supported():
        raise UsageError("train.elastic needs an MPI with ULFM (Open MPI 5: mpirun --with-ft "
                         "ulfm); this MPI has no MPI_Comm_shrink")


def _copy_into(saved, live):
    """``live`` (a state_dict's tree) copied into ``saved``'s tensors where the two trees
    match (no allocation: a snapshot of a 48 MiB MLP state took 33 ms by deepcopy); a fresh
    copy where they do not (an optimizer's state appears after its first step)."""
    import torch

    if isinstance(live, torch.Tensor):
        if isinstance(saved, torch.Tensor) and saved.shape == live.shape \
                and saved.dtype == live.dtype and saved.device == live.device:
            return saved.copy_(live)
        return live.detach().clone()
    if isinstance(live, dict):
        if not isinstance(saved, dict) or saved.keys() != live.keys():
            return copy.deepcopy(live)
        return {k: _copy_into(saved[k], v) for k, v in live.items()}
    if isinstance(live, (list, tuple)):
        if type(saved) is not type(live) or len(saved) != len(live):
            return copy.deepcopy(live)
        return type(live)(_copy_into(a, b) for a, b in zip(saved, live))
    return copy.deepcopy(live)


class Snapshot:
    """One step's state on this rank, in memory (``reuse``: an older snapshot whose tensors
    this one overwrites)."""

    def __init__(self, trainer, reuse: "Optional[Snapshot]" = None):
        self.global_step = trainer.global_step
        self.epoch, self.step_in_epoch = trainer.epoch, trainer.step_in_epoch
        self.order = order(self.global_step, self.step_in_epoch)
        self.position = trainer.position
        self.global_batch, self.ranks = trainer.loader.global_batch, trainer.ctx.size
        self.task = _copy_into(reuse.task if reuse is not None else None,
                               trainer.task.state_dict())
        if "models" in self.task:  # local SGD between two averages keeps the ranks' mean
            self.task["models"] = trainer.strategy.snapshot_models(self.task["models"])
        self.acc = copy.deepcopy(trainer.acc)
        from . import checkpoint as ckpt  # (torch: here, so that importing this module is light)

        self.rng = ckpt.rng_state(trainer.task)
        self.callbacks = {cb.name: copy.deepcopy(cb.state_dict()) for cb in trainer.callbacks}

    def nbytes(self) -> int:
        import torch

        total = 0

        def walk(x):
            nonlocal total
            if isinstance(x, torch.Tensor):
                total += x.numel() * x.element_size()
            elif isinstance(x, dict):
                for v in x.values():
                    walk(v)
            elif isinstance(x, (list, tuple)):
                for v in x:
                    walk(v)

        walk(self.task)
        return total


def order(global_step: int, step_in_epoch: int) -> int:
    """Where a state lies in the run, as one number the survivors can agree on: a step's
    state inside its epoch, then (2 x step + 1) the same step past its epoch's end (record,
    validation and checkpoint done; the next epoch at its first step). Recovery to the first
    would run that epoch's end twice."""
    return 2 * global_step + (step_in_epoch == 0)


class Snapshots:
    """The last two snapshots, one taken every ``every`` steps and one at each epoch's end."""

    def __init__(self, every: int = 1):
        self.every = max(1, int(every))
        self.kept: List[Snapshot] = []

    def maybe_take(self, trainer, force: bool = False) -> None:
        if force or trainer.global_step % self.every == 0:
            if self.kept and self.kept[-1].order == order(trainer.global_step,
                                                          trainer.step_in_epoch):
                return
            reuse = self.kept.pop(0) if len(self.kept) == 2 else None
            self.kept.append(Snapshot(trainer, reuse))

    def newest(self) -> int:
        """The newest snapshot's :func:`order`."""
        return self.kept[-1].order

    def at(self, where: int) -> Snapshot:
        for s in self.kept:
            if s.order == where:
                return s
        raise RuntimeError(f"no snapshot at {where} (2 x step + past the epoch's end) on this "
                           f"rank (kept: {[s.order for s in self.kept]})")


@dataclass
class Joining:
    """What rank 0 sends the ranks it spawned (``Trainer._grow``): enough to build the run's
    Trainer without a check or a file read, and the step to start from."""

    config: dict
    plan: object        # rank 0's Plan, less its task and checkpoint
    snapshot: Snapshot  # rank 0's state at the step boundary
    command: list       # what a later growth spawns
