"""``import mpilearn.tensorflow as hvd``: the ``horovod.tensorflow`` API for TensorFlow 2 custom
loops, over MPI (``import mpilearn.tensorflow.keras as hvd`` is :mod:`mpilearn.keras`).

    hvd.init()
    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)

The collectives take and return ``tf.Tensor``s, eagerly and inside ``tf.function``; they
share the engine (and its mismatch errors) of ``mpilearn.torch``.
"""
from __future__ import annotations

import tensorflow as tf

from ..torch import functions as _functions
from ..torch.basics import (ProcessSet, add_process_set, ccl_built, cross_rank, cross_size,
                            ddl_built, global_process_set, gloo_built, gloo_enabled, init,
                            is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                            mpi_enabled, mpi_threads_supported, rank, remove_process_set,
                            shutdown, size, start_timeline, stop_timeline)
from ..torch.engine import Adasum, Average, HorovodInternalError, Max, Min, Product, Sum
from . import elastic
from .compression import Compression
from .gradients import DistributedGradientTape, DistributedOptimizer, broadcast_variables
from .mpi_ops import (allgather, alltoall, barrier, broadcast, broadcast_, grouped_allgather,
                      join)
from .ops import allreduce, grouped_allreduce, grouped_reducescatter, reducescatter


def nccl_built() -> int:
    return 0   # the transport is MPI on host memory


def cuda_built() -> bool:
    return tf.test.is_built_with_cuda()


def rocm_built() -> bool:
    return tf.test.is_built_with_rocm()


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """``root_rank``'s object on every rank (pickled; cloudpickle when installed)."""
    return _functions.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj, session=None, name=None, process_set=global_process_set) -> list:
    """Every rank's object, in rank order."""
    return _functions.allgather_object(obj, name, process_set)


def broadcast_global_variables(root_rank):
    raise NotImplementedError("broadcast_global_variables is TensorFlow 1 only: use "
                              "hvd.broadcast_variables(model.variables, root_rank)")


# the *_op forms: constants here (Horovod's ops read the same values at run time)
def size_op(process_set_id=0, name=None):
    return tf.constant(size() if process_set_id == 0 else _set_size(process_set_id), tf.int32)


def rank_op(name=None):
    return tf.constant(rank(), tf.int32)


def local_size_op(name=None):
    return tf.constant(local_size(), tf.int32)


def local_rank_op(name=None):
    return tf.constant(local_rank(), tf.int32)


def process_set_included_op(process_set_id=0, name=None):
    from ..torch.basics import _world

    return tf.constant(int(rank() in _world().set_ranks[process_set_id]), tf.int32)


def _set_size(process_set_id) -> int:
    from ..torch.basics import _world

    return len(_world().set_ranks[process_set_id])
