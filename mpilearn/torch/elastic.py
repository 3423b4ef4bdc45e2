"""``hvd.elastic``: Horovod's elastic API (0.28: ``run``, ``TorchState``, ``ElasticSampler``,
``HorovodInternalError``, ``HostsUpdatedInterrupt``) on MPI's ULFM, through
``mpilearn.core.membership`` (the same mechanism the training driver uses).

Horovod's documented semantics, kept: the state is synchronised from rank 0 before the
wrapped function runs; a lost worker raises ``HorovodInternalError`` inside a collective; the
survivors restore the last ``commit()``, rebuild the job without it (here: revoke and shrink
the communicator, no new rendezvous), call the reset callbacks, synchronise from the new rank 0
and run the function again. Differences: ``check_host_updates`` has no host driver to ask, so
it never raises; growing back in process is built for ``python -m mpilearn.train`` runs only
(``Trainer._grow``), so here hosts are only ever removed.
"""
from __future__ import annotations

import copy
import functools
import os
from typing import Callable, List

import numpy as np
import torch

from ..core import comm as mcomm
from ..core import membership as mship
from . import basics
from .engine import HorovodInternalError


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added or removed; ``skip_sync``: the state need not be synchronised (no
    worker was added)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


# -- the state --------------------------------------------------------------------------------
class State:
    """What ``run`` keeps in step across the workers: ``save``/``restore``/``sync`` by the
    subclasses; reset callbacks run after a membership change, before the sync."""

    def __init__(self):
        self._reset_callbacks: List[Callable] = []

    def register_reset_callbacks(self, callbacks) -> None:
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for fn in self._reset_callbacks:
            fn()

    def commit(self) -> None:
        """Keep this state in memory (the point a failure rolls back to)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """No host driver tells this job of new hosts: nothing to raise."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        pass

    def rebind(self, comm) -> None:
        """After a loss: whatever this state holds that reduces over the old communicator
        (a DistributedOptimizer) reduces over ``comm`` from now on."""


class ObjectState(State):
    """Plain Python values given as keywords, kept as attributes."""

    def __init__(self, **kwargs):
        object.__setattr__(self, "_values", dict(kwargs))
        super().__init__()
        for k, v in kwargs.items():
            object.__setattr__(self, k, v)

    def save(self) -> None:
        self._values = {k: copy.deepcopy(getattr(self, k)) for k in self._values}

    def restore(self) -> None:
        for k, v in self._values.items():
            object.__setattr__(self, k, copy.deepcopy(v))

    def sync(self) -> None:
        if self._values:
            self._values = basics_broadcast_object(self._values)
            self.restore()


def basics_broadcast_object(obj):
    from .functions import broadcast_object

    return broadcast_object(obj, 0)


class _Handler:
    """How one tracked object is saved, restored and synchronised."""

    def __init__(self, value):
        self.value = value
        self.save()

    def save(self):
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def sync(self):
        raise NotImplementedError


class _ModelHandler(_Handler):
    def sync(self):
        from .functions import broadcast_parameters

        broadcast_parameters(self.value.state_dict(), 0)


class _OptimizerHandler(_Handler):
    def sync(self):
        from .functions import broadcast_optimizer_state

        broadcast_optimizer_state(self.value, 0)


class _SamplerHandler(_Handler):
    def sync(self):
        self.value.load_state_dict(basics_broadcast_object(self.value.state_dict()))


def _handler_for(value):
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler(value)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    return None


class TorchState(ObjectState):
    """A model, an optimizer, samplers and plain values (epoch, batch, ...) as one state."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        handled = {k: v for k, v in dict(kwargs, model=model, optimizer=optimizer).items()
                   if v is not None and _handler_for(v) is not None}
        object.__setattr__(self, "_handlers", {k: _handler_for(v) for k, v in handled.items()})
        plain = {k: v for k, v in kwargs.items() if k not in handled}
        super().__init__(**plain)
        for k, v in handled.items():
            object.__setattr__(self, k, v)

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name] = _handler_for(value)
        object.__setattr__(self, name, value)

    def rebind(self, comm) -> None:
        from .optimizer import rebind

        for h in self._handlers.values():
            if isinstance(h, _OptimizerHandler):
                rebind(h.value, comm)

    def save(self):
        for h in self._handlers.values():
            h.save()
        super().save()

    def restore(self):
        for h in self._handlers.values():
            h.restore()
        super().restore()

    def sync(self):
        for h in self._handlers.values():
            h.sync()
        super().sync()


# -- the sampler -------------------------------------------------------------------------------
class ElasticSampler(torch.utils.data.Sampler):
    """This rank's share of the indices not yet processed in the epoch, in one order that every
    rank shares (``seed`` + epoch); after a membership change, what is left is shared again
    among the new ranks. Call ``record_batch`` after each batch and ``set_epoch`` at an epoch's
    end (not its start: a resumed epoch must not start over)."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch, self.processed_num = 0, 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.processed_num = epoch, 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """A batch of ``batch_size`` per rank was processed on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices) -> None:
        self.processed_num += len(indices) * self.num_replicas

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.processed_num = state["epoch"], state["processed_num"]
        self.reset()

    def reset(self) -> None:
        self.num_replicas, self.rank = basics.size(), basics.rank()
        n = len(self.dataset)
        order = (np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle
                 else np.arange(n))
        self.remaining_indices = [int(i) for i in order[self.processed_num:]]
        self.num_samples = -(-len(self.remaining_indices) // self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        left = self.remaining_indices
        padded = left + left[:self.total_size - len(left)]  # every rank the same count
        return iter(padded[self.rank::self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


# -- the loop ---------------------------------------------------------------------------------
def _membership() -> mship.Membership:
    """The job's membership, made on first use (after hvd.init) over hvd's world."""
    m = mship.current()
    if m is None:
        ctx = basics._world().ctx
        m = mship.Membership(ctx.comm, int(os.environ.get("MPILEARN_ELASTIC_MIN_RANKS") or 1))
        for state in basics._world().sets.values():
            if state is not None:
                for c in (state.comm, state.meta, state.data, state.aux, state.sync):
                    c.Set_errhandler(mcomm.mpi().ERRORS_RETURN)
        m.on_change(lambda new, change: _rebuild_world(new))
        mship.set_current(m)
    return m


def _rebuild_world(new) -> None:
    """hvd's world becomes the survivors (rank 0 is the lowest of them)."""
    mcomm.replace_comm(mcomm.context(), new)
    basics.reinit(mcomm.context())


# MPI's texts for a lost process, as they survive a framework's wrapping (TensorFlow's
# py_function turns the Python exception into a tf.errors.UnknownError holding only its text)
_LOSS_TEXTS = ("MPI_ERR_PROC_FAILED", "MPI_ERR_REVOKED")


def _lost(err: BaseException) -> bool:
    """A lost process, reported by MPI directly or wrapped by a collective's handle."""
    seen = err
    while seen is not None:
        if mship.is_failure(seen) or isinstance(seen, mship.RanksLost):
            return True
        if any(t in str(seen) for t in _LOSS_TEXTS):
            return True
        seen = seen.__cause__ or seen.__context__
    return isinstance(err, HorovodInternalError)


def run(func):
    """Decorator: ``func(state, ...)`` runs on every rank from a synchronised state, and again
    on the survivors (from the last commit) whenever a rank is lost."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        membership = _membership()
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as interrupt:
                skip_sync = interrupt.skip_sync
            except Exception as err:  # noqa: BLE001 - only a lost rank is handled here
                if not _lost(err):
                    raise
                state.restore()
                change = membership.recover()
                state.rebind(mcomm.context().comm)
                if basics.rank() == 0:
                    print(f"mpilearn: hvd.elastic: {change.describe()}; going on from the last "
                          "commit", flush=True)
                if change.new_size < membership.min_ranks:
                    raise
                skip_sync = False
            state.on_reset()

    return wrapper


__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler",
           "HorovodInternalError", "HostsUpdatedInterrupt"]
