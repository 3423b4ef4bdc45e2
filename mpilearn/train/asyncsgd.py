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

from ..core.flat import FlatBuffer

HEADER = 4                    # int64 slots before the payload
TAG_EXCHANGE = 500            # + optimizer index
TAG_DONE = 499


class Worker:
    """A worker's side of one optimizer: accumulate, exchange every ``sync_every`` steps."""

    def __init__(self, opt, adapter, index: int, comm, algorithm: str, sync_every: int):
        self.opt, self.adapter, self.index, self.comm = opt, adapter, index, comm
        self.algorithm, self.sync_every, self.since, self.version = algorithm, sync_every, 0, 0
        self.flat = FlatBuffer(adapter.tensors(opt), header=HEADER)
        self.acc = [torch.zeros_like(p) for p in self.flat.tensors]
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
            self.adapter.refresh(self.opt, self.flat.tensors)
            self.exchange([p.data for p in self.flat.tensors])

    def exchange(self, tensors) -> None:
        from mpi4py import MPI

        from ..cluster import preempt

        start = time.perf_counter()
        flat = self.flat
        flat.pack(tensors)
        flat.header[:] = (self.version, self.steps_done, self.since,
                          int(preempt.requested() is not None))
        self.comm.Send([flat.message, MPI.BYTE], dest=0, tag=TAG_EXCHANGE + self.index)
        self.comm.Recv([flat.message, MPI.BYTE], source=0, tag=TAG_EXCHANGE + self.index)
        self.version, over = int(flat.header[0]), bool(flat.header[1])
        self.epoch_over = self.epoch_over or over
        with torch.no_grad():
            for p, v in zip(flat.tensors, flat.views()):
                if self.algorithm == "downpour":
                    p.copy_(v)          # the centre parameters
                else:
                    p.sub_(v)           # the elastic move
        self.adapter.write(self.opt, flat.tensors)
        for acc in self.acc:
            acc.zero_()
        self.since = 0
        self.seconds += time.perf_counter() - start

    def pop_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class Master:
    """Rank 0: serves the workers' exchanges for one epoch at a time."""

    def __init__(self, optimizers: List, adapter, comm, algorithm: str, elastic_force: float,
                 max_staleness: int):
        self.opts, self.adapter, self.comm, self.algorithm = optimizers, adapter, comm, algorithm
        self.alpha = elastic_force
        self.workers = comm.Get_size() - 1
        self.max_staleness = max_staleness or 2 * self.workers
        self.flats = [FlatBuffer(adapter.tensors(o), header=HEADER) for o in optimizers]
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
            self.comm.Recv([flat.message, MPI.BYTE], source=source, tag=tag)
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
                flat.pack()                              # answer: the centre
            else:
                with torch.no_grad():
                    for p, x in zip(flat.tensors, flat.views()):
                        move = (x - p) * self.alpha
                        p.add_(move)
                        x.copy_(move)                    # answer: the elastic move
                self.adapter.write(self.opts[k], flat.tensors)
                self.versions[k] += 1
            over = over or sum(steps) >= target_steps or stop_signal()
            flat.header[:] = (self.versions[k], int(over), 0, 0)
            self.comm.Send([flat.message, MPI.BYTE], dest=source, tag=tag)
        return {"staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
                "staleness_max": int(max(staleness, default=0)), "dropped_gradients": dropped,
                "centre_updates": list(self.versions),  # per optimizer, since the start
                "preempted": preempted, "workers": [done[w] for w in sorted(done)]}

    def _apply_gradient(self, k: int) -> None:
        flat, opt = self.flats[k], self.opts[k]
        self.adapter.apply(opt, flat.views())
        self.adapter.refresh(opt, flat.tensors)
        self.versions[k] += 1
