"""The public reducing collectives of ``horovod.tensorflow``: compression, the deprecated
``average`` argument and ``tf.IndexedSlices`` (reduced by allgathering values and indices,
as Horovod does) on top of the raw ones in :mod:`.mpi_ops`."""
from __future__ import annotations

import tensorflow as tf

from ..torch.basics import global_process_set, state_of
from ..torch.collectives import resolve_op
from ..torch.engine import Adasum, Average, Sum
from .compression import Compression
from .mpi_ops import _grouped_allreduce, _reducescatter, grouped_allgather


def _sparse(slices, op, prescale_factor, postscale_factor, process_set):
    if op == Adasum:
        raise NotImplementedError("The Adasum reduction does not currently support sparse "
                                  "tensors. As a workaround please pass sparse_as_dense=True "
                                  "to DistributedOptimizer")
    if op not in (Sum, Average):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
    n = state_of(process_set).size
    values = grouped_allgather([s.values for s in slices], process_set=process_set)
    indices = grouped_allgather([s.indices for s in slices], process_set=process_set)
    return [tf.IndexedSlices(v / tf.cast(n, v.dtype) if op == Average else v, i, s.dense_shape)
            for v, i, s in zip(values, indices, slices)]


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set, name=None,
                      ignore_name_scope=False, comm=None):
    """Each tensor reduced over the process set, or over ``comm`` (an mpi4py communicator,
    mpilearn's), Average unless ``op`` says; dense tensors of one dtype travel as one fused
    buffer."""
    op = resolve_op(op, average)
    out = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if sparse:
        if comm is not None:
            raise NotImplementedError("tf.IndexedSlices with comm=: use sparse_as_dense=True")
        for i, r in zip(sparse, _sparse([tensors[i] for i in sparse], op, prescale_factor,
                                        postscale_factor, process_set)):
            out[i] = r
    if dense:
        pairs = [compression.compress(tensors[i]) for i in dense]
        reduced = _grouped_allreduce([p[0] for p in pairs], name, op, prescale_factor,
                                     postscale_factor, process_set, comm)
        for i, r, (_, ctx) in zip(dense, reduced, pairs):
            out[i] = compression.decompress(r, ctx)
    return out


def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set=global_process_set, ignore_name_scope=False):
    """``tensor`` (a tf.Tensor, tf.Variable or tf.IndexedSlices) reduced over the ranks."""
    return grouped_allreduce([tensor], average, device_dense, device_sparse, compression, op,
                             prescale_factor, postscale_factor, process_set, name)[0]


def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """The reduction over the set, split along the first dimension: this rank's part (the
    first ``dim % size`` ranks get one row more)."""
    compressed, ctx = compression.compress(tensor)
    out = _reducescatter(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average,
                          name=None, process_set=global_process_set, ignore_name_scope=False,
                          prescale_factor=1.0, postscale_factor=1.0):
    return [reducescatter(t, device_dense, compression, op,
                          None if name is None else f"{name}.{i}", process_set,
                          ignore_name_scope, prescale_factor, postscale_factor)
            for i, t in enumerate(tensors)]
