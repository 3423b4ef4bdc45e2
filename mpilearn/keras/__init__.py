"""``import mpilearn.keras as hvd`` (or ``mpilearn.tensorflow.keras``): the
``horovod.tensorflow.keras`` surface for Keras 3, on the TensorFlow and torch backends.

    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size()))
    model.compile(optimizer=opt, loss="mse")
    model.fit(x_shard, y_shard, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                           hvd.callbacks.MetricAverageCallback()],
              verbose=1 if hvd.rank() == 0 else 0)

Collectives take backend tensors, arrays or numbers and return backend tensors; they run
through the same engine as ``mpilearn.torch``. JAX is not supported. Only rank 0 should
write files (``ModelCheckpoint``, logs).
"""
from __future__ import annotations

import keras
import numpy as np

from .. import torch as _t
from ..torch import (Adasum, Average, Compression, HorovodInternalError, Max, Min, Product,
                     ProcessSet, Sum, add_process_set, ccl_built, cross_rank, cross_size,
                     cuda_built, ddl_built, global_process_set, gloo_built, gloo_enabled,
                     init, is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                     mpi_enabled, mpi_threads_supported, nccl_built, rank, remove_process_set,
                     rocm_built, shutdown, size)
from . import callbacks, elastic
from .callbacks import (BroadcastGlobalVariablesCallback, LearningRateScheduleCallback,
                        LearningRateWarmupCallback, MetricAverageCallback)
from .optimizer import DistributedOptimizer, allreduce_arrays, broadcast_variables

__all__ = ["Adasum", "Average", "Compression", "HorovodInternalError", "Max", "Min", "Product",
           "ProcessSet", "Sum", "add_process_set", "ccl_built", "cross_rank", "cross_size",
           "cuda_built", "ddl_built", "global_process_set", "gloo_built", "gloo_enabled", "init",
           "is_homogeneous", "is_initialized", "local_rank", "local_size", "mpi_built",
           "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "remove_process_set",
           "rocm_built", "shutdown", "size", "callbacks", "elastic",
           "BroadcastGlobalVariablesCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "MetricAverageCallback",
           "DistributedOptimizer", "allreduce", "allgather", "broadcast", "alltoall",
           "reducescatter", "grouped_allreduce", "grouped_allgather", "grouped_reducescatter",
           "broadcast_object", "allgather_object", "broadcast_variables", "join", "barrier",
           "broadcast_global_variables", "load_model", "allreduce_arrays"]


def _torch_of(value):
    import torch

    array = np.asarray(keras.ops.convert_to_numpy(value))
    return torch.from_numpy(np.array(array, copy=True))


def _back(tensor):
    return keras.ops.convert_to_tensor(tensor.numpy())


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
              op=None, compression=Compression.none, process_set=global_process_set, comm=None):
    """``value`` reduced over the ranks (Average unless ``op``/``average`` say otherwise)."""
    return _back(_t.allreduce(_torch_of(value), average, name, compression, op, prescale_factor,
                              postscale_factor, process_set, comm))


def grouped_allreduce(values, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
                      op=None, compression=Compression.none, process_set=global_process_set,
                      comm=None):
    return [_back(t) for t in _t.grouped_allreduce([_torch_of(v) for v in values], average, name,
                                                   compression, op, prescale_factor,
                                                   postscale_factor, process_set, comm)]


def allgather(value, name=None, process_set=global_process_set, comm=None):
    return _back(_t.allgather(_torch_of(value), name, process_set, comm))


def grouped_allgather(values, name=None, process_set=global_process_set, comm=None):
    return [_back(t) for t in _t.grouped_allgather([_torch_of(v) for v in values], name,
                                                   process_set, comm)]


def broadcast(value, root_rank, name=None, process_set=global_process_set, comm=None):
    return _back(_t.broadcast(_torch_of(value), root_rank, name, process_set, comm))


def alltoall(value, splits=None, name=None, process_set=global_process_set, comm=None):
    out = _t.alltoall(_torch_of(value), None if splits is None else _torch_of(splits), name,
                      process_set, comm)
    return (_back(out[0]), _back(out[1])) if isinstance(out, tuple) else _back(out)


def reducescatter(value, name=None, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0, comm=None):
    return _back(_t.reducescatter(_torch_of(value), name, Compression.none, op, process_set,
                                  prescale_factor, postscale_factor, comm))


def grouped_reducescatter(values, name=None, op=Average, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0, comm=None):
    return [reducescatter(v, None if name is None else f"{name}.{i}", op, process_set,
                          prescale_factor, postscale_factor, comm) for i, v in enumerate(values)]


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set, comm=None):
    return _t.broadcast_object(obj, root_rank, name, process_set, comm)


def allgather_object(obj, name=None, process_set=global_process_set, comm=None):
    return _t.allgather_object(obj, name, process_set, comm)


def join(device=-1) -> int:
    return _t.join(device)


def barrier(process_set=global_process_set, comm=None) -> None:
    _t.barrier(process_set, comm)


def broadcast_global_variables(root_rank):
    raise NotImplementedError("broadcast_global_variables is TensorFlow 1 only: use "
                              "hvd.callbacks.BroadcastGlobalVariablesCallback or "
                              "hvd.broadcast_variables(model.variables, root_rank)")


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, **kwargs):
    """``keras.models.load_model`` whose optimizer comes back wrapped in DistributedOptimizer."""
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        objects[cls.__name__] = cls
    model = keras.models.load_model(filepath, custom_objects=objects or None, **kwargs)
    if getattr(model, "optimizer", None) is not None:
        DistributedOptimizer(model.optimizer, compression=compression)
    return model
