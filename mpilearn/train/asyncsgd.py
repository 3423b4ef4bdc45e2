"""Asynchronous master/worker training: Downpour SGD and elastic averaging (EASGD).

Rank 0 of the training communicator is the master: it holds the centre parameters of every
optimizer of the task and trains on no data. The other ranks are workers that train on their
own shard with their own copy of the task and, every ``sync_every`` optimizer steps, exchange
one fused message per optimizer with the master:

- **downpour**: the worker sends the mean gradient of its steps since the last exchange; the
  master applies it with its own optimizer and answers with the centre parameters, which
  replace the worker's. Between exchanges the worker steps its local optimizer.
- **easgd**: the worker sends its parameters x; the master moves the centre c by
  d = alpha (x - c) and answers d; the worker moves x by -d (Zhang et al. 2015, asynchronous).

Every message is ``header (int64) + payload`` in one buffer. The master never busy-waits: it
probes, and sleeps (50 us growing to 2 ms) when nothing has arrived. Staleness is the number
of centre updates between a worker's fetch and its next gradient; downpour gradients staler
than ``max_staleness`` are dropped (the worker still gets fresh parameters), and the mean and
maximum staleness are logged per epoch.

An epoch ends when the workers together have done ``steps_per_epoch x workers`` steps, so a
slow worker does not hold the fast ones back: the master answers "epoch over" from then on,
and every worker stops after its current step.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional

import numpy as np
import torch

HEADER = 4                    # int64 slots before the payload
TAG_EXCHANGE = 500            # + optimizer index
TAG_DONE = 499


def _is_keras(opt) -> bool:
    return hasattr(opt, "_trainable_variables") and not hasattr(opt, "param_groups")


def _params(opt) -> List[torch.Tensor]:
    """The tensors an optimizer updates; for a Keras optimizer, torch copies of its variables
    (written back after every exchange)."""
    if _is_keras(opt):
        import keras

        return [torch.from_numpy(np.array(keras.ops.convert_to_numpy(v), dtype=np.float32))
                for v in opt._trainable_variables]
    return [p for g in opt.param_groups for p in g["params"]]


def _refresh(opt, params: List[torch.Tensor]) -> None:
    """A Keras optimizer's torch copies take its variables' current values (after apply)."""
    if _is_keras(opt):
        import keras

        for p, v in zip(params, opt._trainable_variables):
            p.copy_(torch.from_numpy(np.asarray(keras.ops.convert_to_numpy(v))))


def _write_back(opt, params: List[torch.Tensor]) -> None:
    if _is_keras(opt):
        for v, p in zip(opt._trainable_variables, params):
            v.assign(p.numpy())


class _Flat:
    """One optimizer's parameters as a message: int64 header + payload in one byte buffer."""

    def __init__(self, params: List[torch.Tensor]):
        self.params = params
        self.dtype = params[0].dtype if params else torch.float32
        self.numel = sum(p.numel() for p in params)
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        self.buf = np.zeros(HEADER * 8 + self.numel * itemsize, dtype=np.uint8)
        self.header = self.buf[:HEADER * 8].view(np.int64)
        self.payload = torch.from_numpy(self.buf[HEADER * 8:]).view(self.dtype)

    def pack(self, tensors) -> None:
        offset = 0
        for t in tensors:
            n = t.numel()
            self.payload[offset:offset + n].copy_(t.detach().reshape(-1))
            offset += n

    def views(self):
        offset = 0
        for p in self.params:
            n = p.numel()
            yield p, self.payload[offset:offset + n].view_as(p)
            offset += n


class _Worker:
    """A worker's side of one optimizer: accumulate, exchange every ``sync_every`` steps."""

    def __init__(self, opt, index: int, comm, algorithm: str, sync_every: int):
        self.opt, self.index, self.comm, self.algorithm = opt, index, comm, algorithm
        self.sync_every, self.since, self.version = sync_every, 0, 0
        self.flat = _Flat(_params(opt))
        self.acc = [torch.zeros_like(p) for p in self.flat.params]
        self.seconds = 0.0
        self.epoch_over = False
        self.steps_done = 0   # steps of the running epoch, reported to the master

    def before_step(self, grads: List[Optional[torch.Tensor]]) -> bool:
        """Counts the step; downpour accumulates ``grads``. True: exchange instead of stepping."""
        self.since += 1
        due = self.since % self.sync_every == 0
        if self.algorithm == "downpour":
            for acc, g in zip(self.acc, grads):
                if g is not None:
                    acc.add_(g)
            if due:
                self.exchange([a / self.since for a in self.acc])
                return True
        return False

    def after_step(self) -> None:
        if self.algorithm == "easgd" and self.since % self.sync_every == 0:
            _refresh(self.opt, self.flat.params)
            self.exchange([p.data for p in self.flat.params])

    def exchange(self, tensors) -> None:
        from mpi4py import MPI

        from .. import preempt

        start = time.perf_counter()
        flat = self.flat
        flat.pack(tensors)
        flat.header[:] = (self.version, self.steps_done, self.since,
                          int(preempt.requested() is not None))
        self.comm.Send([flat.buf, MPI.BYTE], dest=0, tag=TAG_EXCHANGE + self.index)
        self.comm.Recv([flat.buf, MPI.BYTE], source=0, tag=TAG_EXCHANGE + self.index)
        self.version, over = int(flat.header[0]), bool(flat.header[1])
        self.epoch_over = self.epoch_over or over
        with torch.no_grad():
            for p, v in flat.views():
                if self.algorithm == "downpour":
                    p.copy_(v)          # the centre parameters
                else:
                    p.sub_(v)           # the elastic move
        _write_back(self.opt, flat.params)
        for acc in self.acc:
            acc.zero_()
        self.since = 0
        self.seconds += time.perf_counter() - start


class _TorchWorkerMixin:
    """Mixed into a worker's torch optimizer: ``step()`` trains locally and exchanges."""

    def step(self, closure=None):
        w = self._async
        if w.before_step([p.grad for p in w.flat.params]):
            return None  # the master's step replaces ours
        result = super().step(closure)
        w.after_step()
        return result

    def gradients_finite(self) -> bool:
        return all(bool(torch.isfinite(p.grad).all()) for p in self._async.flat.params
                   if p.grad is not None)


class _KerasWorkerMixin:
    """Mixed into a worker's Keras optimizer: ``apply()`` trains locally and exchanges."""

    def apply(self, grads, trainable_variables=None):
        import keras

        w = self._async
        as_torch = [None if g is None else
                    torch.from_numpy(np.array(keras.ops.convert_to_numpy(g), dtype=np.float32))
                    for g in grads]
        if w.before_step(as_torch):
            self.iterations.assign_add(1)
            return None
        result = super().apply(grads, trainable_variables)
        w.after_step()
        return result


def make_worker(optimizer, index: int, comm, algorithm: str, sync_every: int):
    base = optimizer.__class__
    mixin = _KerasWorkerMixin if _is_keras(optimizer) else _TorchWorkerMixin
    optimizer.__class__ = type(base.__name__, (mixin, base),
                               {"__module__": base.__module__, "__qualname__": base.__qualname__,
                                "allreduce_seconds": property(_pop_seconds)})
    optimizer._async = _Worker(optimizer, index, comm, algorithm, sync_every)
    return optimizer


def _pop_seconds(opt) -> float:
    seconds, opt._async.seconds = opt._async.seconds, 0.0
    return seconds


class Master:
    """Rank 0: serves the workers' exchanges for one epoch at a time."""

    def __init__(self, optimizers: List, comm, algorithm: str, elastic_force: float,
                 max_staleness: int):
        self.opts, self.comm, self.algorithm = optimizers, comm, algorithm
        self.alpha = elastic_force
        self.workers = comm.Get_size() - 1
        self.max_staleness = max_staleness or 2 * self.workers
        self.flats = [_Flat(_params(o)) for o in optimizers]
        self.versions = [0] * len(optimizers)

    def serve_epoch(self, target_steps: int, stop_signal) -> dict:
        """Until every worker reported the end of its epoch; returns the epoch's statistics."""
        from mpi4py import MPI

        status = MPI.Status()
        steps = [0] * (self.workers + 1)
        done: Dict[int, dict] = {}
        staleness: List[int] = []
        dropped = 0
        over = preempted = False
        sleep = 5e-5
        while len(done) < self.workers:
            if not self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
                time.sleep(sleep)
                sleep = min(sleep * 2, 2e-3)
                continue
            sleep = 5e-5
            source, tag = status.Get_source(), status.Get_tag()
            if tag == TAG_DONE:
                done[source] = self.comm.recv(source=source, tag=TAG_DONE)
                over = over or bool(done[source].get("stopped"))
                continue
            k = tag - TAG_EXCHANGE
            flat = self.flats[k]
            self.comm.Recv([flat.buf, MPI.BYTE], source=source, tag=tag)
            fetched, steps[source] = int(flat.header[0]), int(flat.header[1])
            if flat.header[3] and not over:  # a worker got the stop signal
                over = preempted = True
            stale = self.versions[k] - fetched
            staleness.append(stale)
            if self.algorithm == "downpour":
                if stale <= self.max_staleness:
                    self._apply_gradient(k)
                else:
                    dropped += 1
                flat.pack(flat.params)                   # answer: the centre
            else:
                with torch.no_grad():
                    for p, x in flat.views():
                        move = (x - p) * self.alpha
                        p.add_(move)
                        x.copy_(move)                    # answer: the elastic move
                _write_back(self.opts[k], flat.params)
                self.versions[k] += 1
            over = over or sum(steps) >= target_steps or stop_signal()
            flat.header[:] = (self.versions[k], int(over), 0, 0)
            self.comm.Send([flat.buf, MPI.BYTE], dest=source, tag=tag)
        return {"staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
                "staleness_max": int(max(staleness, default=0)), "dropped_gradients": dropped,
                "centre_updates": list(self.versions),  # per optimizer, since the start
                "preempted": preempted, "workers": [done[w] for w in sorted(done)]}

    def _apply_gradient(self, k: int) -> None:
        flat, opt = self.flats[k], self.opts[k]
        if _is_keras(opt):
            opt.apply([g.numpy().copy() for _, g in flat.views()], opt._trainable_variables)
            _refresh(opt, flat.params)
        else:
            for p, g in flat.views():
                p.grad = g.clone()
            opt.step()
        self.versions[k] += 1


# -- wiring into the engine ------------------------------------------------------------------

def setup(task, comm, device: str, train: dict) -> Optional[Master]:
    """Everyone starts from rank 0's weights and optimizer state; rank 0 becomes the master,
    the others wrap their optimizers. The task itself trains locally (COMM_SELF)."""
    from mpi4py import MPI

    from .. import torch as mtorch

    task.setup(MPI.COMM_SELF, device, train["backend"], 0, distributed=False)
    broadcast_centre(task, comm)
    opts = list(task.optimizers().values())
    for opt in opts:
        if _is_keras(opt):
            from .. import keras as mkeras

            mkeras.broadcast_variables(opt.variables, 0, comm)
        else:
            mtorch.broadcast_optimizer_state(opt, 0, comm=comm)
    if comm.Get_rank() == 0:
        return Master(opts, comm, train["algorithm"], train["elastic_force"], train["max_staleness"])
    for k, opt in enumerate(opts):
        make_worker(opt, k, comm, train["algorithm"], train["sync_every"])
    return None


def work_epoch(trainer, task) -> None:
    """A worker's epoch: its shard, then again from the start (a new order) while the master
    has not called the epoch over; then it reports to the master."""
    from .tasks import TrainingStopped

    opts = [opt._async for opt in task.optimizers().values()]
    for opt in opts:
        opt.epoch_over, opt.steps_done = False, 0
    acc, steps, stopped = trainer.acc, 0, None
    start_wall = time.perf_counter()
    for round_ in range(1 << 30):
        seen = 0
        batches = trainer.loader.batches(trainer.epoch + 7919 * round_)
        try:
            for batch in batches:
                seen += 1
                trainer._set_lr()
                for opt in opts:  # the step in progress counts: the master ends the epoch on it
                    opt.steps_done = steps + 1
                try:
                    losses = task.train_step(batch)
                except TrainingStopped as err:  # tell the master; everyone stops together
                    stopped = str(err)
                    break
                steps += 1
                for k, v in losses.items():
                    acc["losses"][k] = acc["losses"].get(k, 0.0) + v
                if any(opt.epoch_over for opt in opts):
                    break
        finally:
            batches.close()
        if stopped or any(opt.epoch_over for opt in opts):
            break
        if seen == 0:
            raise RuntimeError("this worker's data shard is empty")
    report = {"losses": acc["losses"], "steps": steps,
              "samples": steps * trainer.config["train"]["batch_size"],
              "seconds": time.perf_counter() - start_wall, "stopped": stopped}
    acc["losses"] = {}  # the master reports the epoch's losses
    trainer.ctx.comm.send(report, dest=0, tag=TAG_DONE)


def broadcast_centre(task, comm) -> None:
    """The master's centre parameters to every worker (start, epoch ends, before evaluation)."""
    from .. import torch as mtorch

    for model in task.models().values():
        if getattr(task, "framework", "") == "keras":
            from .. import keras as mkeras

            mkeras.broadcast_variables(model.variables, 0, comm)
        else:
            mtorch.broadcast_parameters(model.state_dict(), 0, comm=comm)
