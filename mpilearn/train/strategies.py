"""Distributed-training strategies: how the ranks' updates are combined.

A strategy owns its set-up, its epoch (every side of it: master and workers together), what it
adds to a checkpoint and how the ranks come to hold the same weights at the end of an epoch.
The engine hands it an :class:`EpochContext`, never itself, and it reaches tensors only
through a framework adapter (``adapters.py``). A new algorithm is one new class in
:data:`STRATEGIES`.

=============  ==================================================================================
allreduce      every step averages the gradients of all ranks (synchronous data parallelism)
local_sgd      every rank steps on its own; every ``sync_every`` steps (and at the end of an
               epoch) the weights are averaged (Lin et al. 2020, "Don't use large mini-batches")
downpour       rank 0 is a parameter server applying the workers' gradients as they come
easgd          rank 0 holds a centre that the workers' weights are elastically pulled towards
=============  ==================================================================================
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional

from ..errors import TrainingStopped
from ..core.flat import reduce_tensors
from .adapters import adapter_for


@dataclass
class EpochContext:
    """What an epoch needs from the engine, and the engine's position that it advances."""

    epoch: int                          # 0-based
    steps: int                          # steps per epoch (per worker for the async ones)
    loader: object                      # this rank's ShardedLoader
    acc: dict                           # the epoch's running sums (losses, steps, samples)
    batch_size: int
    set_lr: Callable[[], float]         # before each step (warm-up follows the global step)
    after_step: Callable[..., None]     # after each local step (losses, the next batch or
                                        # its read's DataError): counters, logs, stop check
    stop_requested: Callable[[], bool]  # a stop signal or the deadline (polled by a master)
    step_in_epoch: int = 0              # steps already taken in the epoch (a resumed one)
    position: int = 0                   # events of the epoch's order already consumed
    steps_left: Optional[int] = None    # the synchronous epoch's steps from ``position`` on
    global_step: int = 0                # steps before this epoch's start position
    finished_steps: Optional[int] = None  # set by a strategy that advances in bulk (async)
    restart: bool = False               # the epoch must run again (async, on a stop signal)
    check_read: Optional[Callable[[object], None]] = None  # collective: the first read failed?


class Strategy:
    name = ""
    min_ranks = 1
    trains = True  # this rank runs training steps (an asynchronous master does not)
    beats = True   # ec.after_step follows every step (the watchdog's progress); not async

    def __init__(self, train: dict, comm):
        self.train, self.comm = train, comm
        self.seconds = 0.0  # communication of the strategy's own, beside the optimizers'

    def pop_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def shard(self, rank: int, size: int) -> tuple:
        """(index, count) of this rank's data shard."""
        return rank, size

    def setup(self, task, device: str) -> None:
        raise NotImplementedError

    def run_epoch(self, ec: EpochContext) -> None:
        raise NotImplementedError

    def end_epoch(self) -> None:
        """Collective: afterwards every rank holds the weights to evaluate and to save."""

    def state_dict(self) -> dict:
        """Collective: what a checkpoint needs beyond rank 0's task (None on other ranks)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    # -- elastic training (``elastic.py``): what a strategy adds to the driver's snapshots --
    def rebind(self, comm) -> None:
        """Go on over ``comm``, the survivors' communicator after a lost rank."""
        self.comm = comm

    def snapshot_every(self, every: int) -> int:
        """The steps between in-memory snapshots, given ``train.elastic.snapshot_every``."""
        return every

    def snapshot_models(self, models: dict) -> dict:
        """Collective: the models a snapshot keeps (``models``: this rank's copy)."""
        return models

    def restored(self, size_changed: bool) -> None:
        """Every survivor is back at a snapshot (its models broadcast from rank 0)."""

    def _steps(self, ec: EpochContext, after_step=None) -> None:
        """The synchronous epoch: this rank's batches from ``ec.position`` on. The next
        batch is taken before the step's collective stop check, so a read that fails on any
        rank stops every rank there, together (one message, not a traceback per rank)."""
        left = ec.steps - ec.step_in_epoch if ec.steps_left is None else ec.steps_left
        batches = ec.loader.batches(ec.epoch, ec.position, left)
        try:
            batch = _next(batches) if left > 0 else None
            if ec.check_read is not None:
                ec.check_read(batch)
            while batch is not None:
                ec.set_lr()
                losses = self.task.train_step(batch)
                left -= 1
                batch = _next(batches) if left > 0 else None
                if after_step is not None:
                    after_step()
                ec.after_step(losses, batch)
        finally:
            batches.close()


def _next(batches):
    """The next batch, None at the end, or the DataError that reading it raised."""
    from ..data.hdf5 import DataError

    try:
        return next(batches)
    except StopIteration:
        return None
    except DataError as err:
        return err


class Allreduce(Strategy):
    name = "allreduce"

    def setup(self, task, device):
        self.task = task
        task.setup(self.comm, device, self.train["backend"], int(self.train["fusion_mb"] * (1 << 20)))

    def run_epoch(self, ec):
        self._steps(ec)


class LocalSGD(Strategy):
    """Independent steps, then the average of the weights (and batch-norm statistics) every
    ``sync_every`` global steps and at each epoch's end. Optimizer states stay per rank and are
    checkpointed per rank. With ``sync_every: 1`` and plain or momentum SGD it computes what
    ``allreduce`` does.

    At another rank count (a resume, or the survivors of a lost rank) every rank starts from the
    mean of the ranks' models (between two averages the next average, early: no rank's steps
    are dropped) and from rank 0's optimizer state. Elastic snapshots are taken at averages
    only, where that mean is every rank's model: a loss redoes at most ``sync_every`` steps."""

    name = "local_sgd"

    def setup(self, task, device):
        from mpi4py import MPI

        self.task, self.adapter, self.device = task, adapter_for(task), str(device)
        task.setup(MPI.COMM_SELF, device, self.train["backend"], 0, distributed=False)
        self.adapter.broadcast(task, self.comm)
        self.rebind(self.comm)
        self.steps_done, self.synced = 0, True

    def rebind(self, comm):
        from ..torch.optimizer import get_backend

        self.comm = comm
        self.backend = get_backend("mpi", comm, self.device)

    def run_epoch(self, ec):
        self.steps_done = ec.global_step
        self._steps(ec, self._after_step)

    def _after_step(self) -> None:
        self.steps_done += 1
        self.synced = False
        if self.steps_done % self.train["sync_every"] == 0:
            self.average()

    def average(self) -> None:
        start = time.perf_counter()
        size = self.comm.Get_size()

        def mean_(flat):
            self.backend.wait(self.backend.allreduce_async(flat))
            flat.div_(size)

        averaged = reduce_tensors(self.adapter.model_tensors(self.task), mean_)
        self.adapter.write_models(self.task, averaged)
        self.synced = True
        self.seconds += time.perf_counter() - start

    def end_epoch(self):
        if not self.synced:
            self.average()

    def state_dict(self):
        state = _gather_states(self.comm, self.task.state_dict())
        return dict(state, synced=self.synced) if state is not None else None

    def load_state_dict(self, state):
        _scatter_states(self.comm, state, self.task.load_state_dict)
        states = (state or {}).get("ranks")
        if states is not None and len(states) == self.comm.Get_size():
            self.synced = state.get("synced", True)
            return
        if states is not None and not state.get("synced", True):  # written between averages
            task = self.task.state_dict()  # rank 0's, as the engine loaded it
            task["models"] = models_mean([task["models"]] + [s["models"] for s in states[1:]])
            self.task.load_state_dict(task)
        self.synced = True

    def snapshot_every(self, every):
        return math.lcm(every, self.train["sync_every"])

    def snapshot_models(self, models):
        """Between two averages (a resume at the same size, before its first average) the
        snapshot keeps the ranks' mean, as a checkpoint of this step resumed at another size
        would start from."""
        from ..torch.functions import _to_cpu

        if self.synced:
            return models
        return models_mean(self.comm.allgather(_to_cpu(models)))  # host copies travel

    def restored(self, size_changed):
        if size_changed:  # as a resume at another rank count: rank 0's optimizer state
            self.adapter.broadcast(self.task, self.comm)
        self.synced = True


def models_mean(ranks: list):
    """The mean of the ranks' models (one ``task.state_dict()["models"]`` each, in rank order):
    floating tensors and arrays summed in rank order, then divided; the rest (counters) is the
    first rank's."""
    import numpy as np
    import torch

    first = ranks[0]
    if isinstance(first, dict):
        return {k: models_mean([r[k] for r in ranks]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(models_mean(list(z)) for z in zip(*ranks))
    if isinstance(first, torch.Tensor) and first.is_floating_point():
        total = first.clone()
        for other in ranks[1:]:
            total += other.to(total.device)
        return total / len(ranks)
    if isinstance(first, np.ndarray) and np.issubdtype(first.dtype, np.floating):
        total = first.copy()
        for other in ranks[1:]:
            total += other
        return total / np.asarray(len(ranks), dtype=first.dtype)
    return first


class Asynchronous(Strategy):
    """Downpour and EASGD: rank 0 is the master (``asyncsgd.Master``), the others workers."""

    min_ranks = 2
    beats = False

    def __init__(self, train, comm):
        super().__init__(train, comm)
        self.name = train["algorithm"]
        self.trains = comm.Get_rank() != 0

    def shard(self, rank, size):
        return max(rank - 1, 0), size - 1  # the workers share the data; the master reads none

    def setup(self, task, device):
        """Everyone starts from rank 0's weights and optimizer state; rank 0 becomes the
        master, the others hook their optimizers. The task itself trains locally."""
        from mpi4py import MPI

        from .asyncsgd import Master, Worker

        self.task, self.adapter = task, adapter_for(task)
        task.setup(MPI.COMM_SELF, device, self.train["backend"], 0, distributed=False)
        self.adapter.broadcast(task, self.comm)
        t, opts = self.train, list(task.optimizers().values())
        self.master = None
        if not self.trains:
            self.master = Master(opts, self.adapter, self.comm, t["algorithm"],
                                 t["elastic_force"], t["max_staleness"])
            return
        for k, opt in enumerate(opts):
            self.adapter.hook_step(opt, Worker(opt, self.adapter, k, self.comm, t["algorithm"],
                                               t["sync_every"]))

    def run_epoch(self, ec):
        from ..cluster import preempt

        reason = self._serve(ec) if self.master is not None else self._work(ec)
        reason = self.comm.bcast(reason, root=0)
        self.end_epoch()
        if reason == "preempted":  # the interrupted epoch runs again from the centre
            ec.restart = True
            where = preempt.describe() if preempt.requested() else "a signal on another rank"
            raise preempt.Preempted(f"stopped by {where}")
        ec.finished_steps = ec.steps
        if reason == "deadline":
            raise TrainingStopped("the trial ran past its time limit")
        if reason is not None:
            raise TrainingStopped(reason)

    def _serve(self, ec) -> Optional[str]:
        """The master's epoch; returns why it stopped early (None: it did not)."""
        from ..cluster import preempt

        stats = self.master.serve_epoch(ec.steps * (self.comm.Get_size() - 1), ec.stop_requested)
        done = stats.pop("workers")
        for w in done:
            for k, v in w["losses"].items():
                ec.acc["losses"][k] = ec.acc["losses"].get(k, 0.0) + v
            ec.acc["steps"] += w["steps"]
            ec.acc["samples"] += w["samples"]
        stats["steps_per_worker"] = [w["steps"] for w in done]
        signalled = stats.pop("preempted") or preempt.requested() is not None
        ec.acc["async"] = stats
        reason = next((w["stopped"] for w in done if w.get("stopped")), None)
        if reason is None and signalled:
            return "preempted"
        if reason is None and ec.stop_requested():
            return "deadline"
        return reason

    def _work(self, ec) -> None:
        """A worker's epoch: its shard, then again from the start (a new order) while the
        master has not called the epoch over; then it reports to the master."""
        from .asyncsgd import TAG_DONE

        workers = [opt._worker for opt in self.task.optimizers().values()]
        for w in workers:
            w.epoch_over, w.steps_done = False, 0
        losses_sum: Dict[str, float] = {}
        steps, stopped, start = 0, None, time.perf_counter()
        for round_ in range(1 << 30):
            seen = 0
            batches = ec.loader.batches(ec.epoch + 7919 * round_)
            try:
                for batch in batches:
                    seen += 1
                    ec.set_lr()
                    for w in workers:  # the step in progress counts: it may end the epoch
                        w.steps_done = steps + 1
                    try:
                        losses = self.task.train_step(batch)
                    except TrainingStopped as err:  # tell the master; everyone stops together
                        stopped = str(err)
                        break
                    steps += 1
                    for k, v in losses.items():
                        losses_sum[k] = losses_sum.get(k, 0.0) + v
                    if any(w.epoch_over for w in workers):
                        break
            finally:
                batches.close()
            if stopped or any(w.epoch_over for w in workers):
                break
            if seen == 0:
                raise RuntimeError("this worker's data shard is empty")
        report = {"losses": losses_sum, "steps": steps, "samples": steps * ec.batch_size,
                  "seconds": time.perf_counter() - start, "stopped": stopped}
        self.comm.send(report, dest=0, tag=TAG_DONE)  # the master reports the epoch's losses

    def end_epoch(self):
        """The master's centre weights to every worker."""
        self.adapter.broadcast(self.task, self.comm, optimizers=False)

    def state_dict(self):
        """The workers' own optimizer states (rank 0's task holds the centre and the master's)."""
        return _gather_states(self.comm, {"optimizers": self.task.state_dict()["optimizers"]})

    def load_state_dict(self, state):
        def load(mine):
            full = self.task.state_dict()
            full["optimizers"] = mine["optimizers"]
            self.task.load_state_dict(full)

        _scatter_states(self.comm, state, load)
        # a Keras optimizer's tensors are host copies: they take the restored values
        if self.master is not None:
            for opt, flat in zip(self.master.opts, self.master.flats):
                self.adapter.refresh(opt, flat.tensors)
        else:
            for opt in self.task.optimizers().values():
                self.adapter.refresh(opt, opt._worker.flat.tensors)


STRATEGIES = {"allreduce": Allreduce, "local_sgd": LocalSGD, "downpour": Asynchronous,
              "easgd": Asynchronous}


def make_strategy(train: dict, comm) -> Strategy:
    return STRATEGIES[train["algorithm"]](train, comm)


def _gather_states(comm, mine: dict) -> Optional[dict]:
    """Every rank's state to rank 0: ``{"ranks": [...]}`` (rank 0's own is in the task's)."""
    states = comm.gather(None if comm.Get_rank() == 0 else mine, root=0)
    return {"ranks": states} if comm.Get_rank() == 0 else None


def _scatter_states(comm, state: Optional[dict], load) -> None:
    """Each rank loads its own entry of a checkpoint written by as many ranks; with another
    number of ranks every rank keeps rank 0's state (the engine says so for the RNG streams)."""
    states = (state or {}).get("ranks")
    if states is None or len(states) != comm.Get_size():
        return
    mine = states[comm.Get_rank()]
    if mine is not None:
        load(mine)
