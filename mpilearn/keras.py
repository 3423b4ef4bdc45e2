"""Horovod-shaped API for Keras 3 (TensorFlow and torch backends).

    import mpilearn.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size()))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    model.fit(x_shard, y_shard, callbacks=[hvd.BroadcastGlobalVariablesCallback(0),
                                           hvd.MetricAverageCallback()],
              verbose=1 if hvd.rank() == 0 else 0)

Gradients are averaged over the ranks in one fused buffer, through the same allreduce backend
as the torch path, before the Keras optimizer applies them. This works in a custom loop
(GradientTape, or ``loss.backward()`` on the torch backend) and under ``model.fit()``,
including TensorFlow's compiled train step: there the allreduce is a ``tf.numpy_function``,
so compile with ``jit_compile=False`` (XLA cannot call out to MPI). JAX is not supported.
Only rank 0 should write files (``ModelCheckpoint``, logs).
"""
from __future__ import annotations

from typing import List, Optional

import keras
import numpy as np

from . import comm as _comm
from . import init, local_rank, local_size, rank, size  # noqa: F401  (the Horovod names)

Average = "average"
Sum = "sum"


def _comm_of(comm):
    return comm if comm is not None else _comm.context().comm


def _backend_name() -> str:
    name = keras.backend.backend()
    if name not in ("tensorflow", "torch"):
        raise NotImplementedError(f"mpilearn.keras supports the tensorflow and torch backends, "
                                  f"not {name!r}")
    return name


def _fused_allreduce_(flat, comm, average: bool):
    """In place on a flat torch tensor: the fused-buffer backend of mpilearn.torch."""
    from .torch import get_backend

    backend = get_backend("mpi", comm, str(flat.device))
    backend.wait(backend.allreduce_async(flat))
    if average:
        flat /= comm.Get_size()


def allreduce_arrays(arrays: List[np.ndarray], comm=None, average: bool = True) -> List[np.ndarray]:
    """Sum or mean of each array over the ranks, sent as one buffer; dtypes are kept."""
    import torch

    comm = _comm_of(comm)
    arrays = [np.asarray(a) for a in arrays]
    if comm.Get_size() == 1 or not arrays:
        return arrays
    flat = np.concatenate([a.astype(np.float64 if a.dtype == np.float64 else np.float32).ravel()
                           for a in arrays])
    _fused_allreduce_(torch.from_numpy(flat), comm, average)
    out, offset = [], 0
    for a in arrays:
        out.append(flat[offset:offset + a.size].reshape(a.shape).astype(a.dtype))
        offset += a.size
    return out


def _allreduce_tensors(grads: list, comm, average: bool = True) -> list:
    """Backend tensors in, backend tensors out; inside a tf.function as well."""
    if comm.Get_size() == 1:
        return grads
    if _backend_name() == "torch":
        import torch

        flat = torch.cat([g.detach().reshape(-1) for g in grads])
        _fused_allreduce_(flat, comm, average)
        return [piece.view_as(g) for piece, g in zip(torch.split(flat, [g.numel() for g in grads]), grads)]
    import tensorflow as tf

    dense = [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices -> dense
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(a) for a in allreduce_arrays([g.numpy() for g in dense], comm, average)]
    out = tf.numpy_function(lambda *a: allreduce_arrays(list(a), comm, average), dense,
                            [g.dtype for g in dense], stateful=True, name="mpilearn_allreduce")
    for o, g in zip(out, dense):
        o.set_shape(g.shape)
    return list(out)


def allreduce(value, op: str = Average, comm=None):
    """Mean (or sum) of a tensor, array or number over the ranks, as a numpy value."""
    if op not in (Average, Sum):
        raise ValueError(f"op must be Average or Sum, not {op!r}")
    array = np.asarray(keras.ops.convert_to_numpy(value))
    return allreduce_arrays([array], comm, average=(op == Average))[0]


def broadcast_variables(variables, root_rank: int = 0, comm=None) -> None:
    """Assign root's values to ``variables`` (weights, optimizer slots) on every rank."""
    comm = _comm_of(comm)
    for v in variables:
        value = np.array(keras.ops.convert_to_numpy(v), copy=True).reshape(-1)  # owns its data
        comm.Bcast(value.view(np.uint8), root=root_rank)
        v.assign(value.reshape(v.shape))


class _DistributedMixin:
    """Mixed into the user's optimizer class: ``apply`` averages the gradients first."""

    def apply(self, grads, trainable_variables=None):
        import time

        start = time.perf_counter()
        grads = list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        reduced = _allreduce_tensors([grads[i] for i in present], self._mpilearn_comm,
                                     self._mpilearn_average)
        for i, g in zip(present, reduced):
            grads[i] = g
        # time of the averaging (eager calls; under a compiled fit() it is part of the graph)
        self._mpilearn_seconds = getattr(self, "_mpilearn_seconds", 0.0) + time.perf_counter() - start
        return super().apply(grads, trainable_variables)

    @property
    def allreduce_seconds(self) -> float:
        seconds, self._mpilearn_seconds = getattr(self, "_mpilearn_seconds", 0.0), 0.0
        return seconds


def DistributedOptimizer(optimizer, comm=None, op: str = Average):
    """Wrap a Keras optimizer so that it applies gradients averaged (or summed) over ranks.
    The object stays an instance of the user's optimizer class."""
    _backend_name()
    base = optimizer.__class__
    # same module and name as the base, so saved models carry the plain optimizer
    optimizer.__class__ = type(base.__name__, (_DistributedMixin, base),
                               {"__module__": base.__module__, "__qualname__": base.__qualname__})
    optimizer._mpilearn_comm = _comm_of(comm)
    optimizer._mpilearn_average = op == Average
    return optimizer


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of fit(): every rank takes root's weights and optimizer state."""

    def __init__(self, root_rank: int = 0, comm=None):
        super().__init__()
        self.root_rank, self.comm = root_rank, comm

    def on_train_begin(self, logs=None):
        opt = self.model.optimizer
        if opt is not None and not opt.built:
            opt.build(self.model.trainable_variables)
        broadcast_variables(self.model.variables, self.root_rank, self.comm)
        if opt is not None:
            broadcast_variables(opt.variables, self.root_rank, self.comm)


class MetricAverageCallback(keras.callbacks.Callback):
    """Epoch-end metrics averaged over the ranks (so rank 0's logs speak for all)."""

    def __init__(self, comm=None):
        super().__init__()
        self.comm = comm

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = allreduce_arrays([np.array([float(logs[k]) for k in names])], self.comm)[0]
        logs.update({k: float(v) for k, v in zip(names, values)})


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Horovod-style warm-up: lr goes linearly from ``initial_lr`` to ``initial_lr x size``
    over ``warmup_epochs`` epochs of ``steps_per_epoch`` steps."""

    def __init__(self, initial_lr: float, warmup_epochs: float = 5, steps_per_epoch: int = 1,
                 comm=None):
        super().__init__()
        self.initial_lr, self.warmup_epochs = initial_lr, warmup_epochs
        self.steps_per_epoch, self.comm = steps_per_epoch, comm
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        progress = (self.epoch + (batch + 1) / self.steps_per_epoch) / max(self.warmup_epochs, 1e-9)
        factor = 1 + (_comm_of(self.comm).Get_size() - 1) * min(1.0, progress)
        self.model.optimizer.learning_rate = self.initial_lr * factor
