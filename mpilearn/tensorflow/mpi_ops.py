"""The collectives of ``horovod.tensorflow`` on ``tf.Tensor``s, eager and inside ``tf.function``,
with Horovod's gradients (allreduce: the same allreduce of the gradient; allgather: the
averaged gradient, this rank's rows; broadcast: the averaged gradient on the root, zeros
elsewhere; alltoall: sent back with the received splits; reducescatter: the gathered
gradient). They run on the engine of ``mpilearn.torch`` (same metadata round, same
mismatch errors on every rank)."""
from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import tensorflow as tf

from ..torch import collectives as C
from ..torch.basics import global_process_set, state_of
from ..torch.collectives import resolve_op
from ..torch.engine import Adasum, Average, Sum
from .bridge import run, to_numpy, to_torch


def _check_op(op) -> int:
    op = resolve_op(op, None)
    if op == Adasum:
        raise NotImplementedError("Adasum is not implemented by mpilearn: use op=hvd.Average "
                                  "(or hvd.Sum)")
    return op


def _differentiable(tensor) -> bool:
    return tensor.dtype.is_floating


def _with_grad(tensor, forward, backward):
    """``forward(x)`` whose gradient is ``backward(dy)`` (only for floating tensors)."""
    if not _differentiable(tensor):
        return forward(tensor)

    @tf.custom_gradient
    def op(x):
        return forward(x), backward

    return op(tensor)


def _member_name(name, i):
    return None if name is None else f"{name}.{i}"


# -- allreduce ------------------------------------------------------------------------------

_allreduce_seconds = 0.0  # time in the allreduce bodies (also those run by compiled graphs)


def pop_allreduce_seconds() -> float:
    """Seconds spent in allreduces since the last call (a trainer's per-step accounting)."""
    global _allreduce_seconds
    seconds, _allreduce_seconds = _allreduce_seconds, 0.0
    return seconds


def _fused_allreduce_body(names, op, prescale, postscale, process_set, comm=None):
    """Arrays of one dtype travel as one flat buffer (one metadata round, one allreduce):
    Horovod's tensor fusion. Named tensors keep their own collectives."""
    def body(*arrays):
        global _allreduce_seconds
        start = time.perf_counter()
        try:
            return fused(*arrays)
        finally:
            _allreduce_seconds += time.perf_counter() - start

    def fused(*arrays):
        by_dtype = defaultdict(list)
        for i, a in enumerate(arrays):
            by_dtype[(a.dtype.str, names[i]) if names[i] is not None else a.dtype.str].append(i)
        handles = []
        for key, idx in by_dtype.items():
            flat = np.concatenate([arrays[i].reshape(-1) for i in idx])
            name = key[1] if isinstance(key, tuple) else None
            handles.append((idx, C.allreduce_async(to_torch(flat, True), None, name, op,
                                                   prescale, postscale, process_set, comm)))
        out = [None] * len(arrays)
        for idx, h in handles:
            flat = to_numpy(C.synchronize(h), arrays[idx[0]].dtype)
            offset = 0
            for i in idx:
                n = arrays[i].size
                out[i] = flat[offset:offset + n].reshape(arrays[i].shape)
                offset += n
        return out
    return body


def _grouped_allreduce(tensors, name=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set, comm=None):
    """The raw grouped allreduce (no compression), differentiable; ``comm``: an mpi4py
    communicator instead of the process set (mpilearn's)."""
    op = _check_op(op)
    state_of(process_set, comm)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    names = [_member_name(name, i) for i in range(len(tensors))]
    body = _fused_allreduce_body(names, op, prescale_factor, postscale_factor, process_set, comm)

    def forward(*xs):
        return run(body, xs, [x.dtype for x in xs], [x.shape for x in xs], "mpilearn_allreduce")

    if not all(_differentiable(t) for t in tensors):
        return forward(*tensors)

    @tf.custom_gradient
    def grouped(*xs):
        def grad(*dys):
            return _grouped_allreduce(list(dys), None, op, prescale_factor, postscale_factor,
                                      process_set, comm)
        return forward(*xs), grad

    return list(grouped(*tensors))


def _allreduce(tensor, name=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    return _grouped_allreduce([tensor], name, op, prescale_factor, postscale_factor,
                              process_set)[0]


# -- allgather ------------------------------------------------------------------------------

def _gather_body(names, process_set):
    def body(*arrays):
        handles = [C.allgather_async(to_torch(a, False), names[i], process_set)
                   for i, a in enumerate(arrays)]
        return [to_numpy(C.synchronize(h), a.dtype) for h, a in zip(handles, arrays)]
    return body


def _my_rows(grad, x, process_set):
    """This rank's rows of a gathered gradient."""
    state = state_of(process_set)
    rows = tf.reshape(tf.shape(x)[0] if x.shape.rank else tf.constant(1), [1])
    sizes = tf.reshape(allgather(tf.cast(rows, tf.int32), process_set=process_set), [state.size])
    part = tf.split(grad, sizes, num=state.size, axis=0)[state.rank]
    return tf.reshape(part, tf.shape(x))


def grouped_allgather(tensors, name=None, ignore_name_scope=False,
                      process_set=global_process_set):
    """Each tensor concatenated over the ranks along its first dimension (which may differ)."""
    state_of(process_set)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    names = [_member_name(name, i) for i in range(len(tensors))]

    def forward(*xs):
        shapes = [tf.TensorShape([None]).concatenate(x.shape[1:]) if x.shape.rank else None
                  for x in xs]
        return run(_gather_body(names, process_set), xs, [x.dtype for x in xs], shapes,
                   "mpilearn_allgather")

    if not tensors or not all(_differentiable(t) for t in tensors):
        return forward(*tensors)

    @tf.custom_gradient
    def gathered(*xs):
        def grad(*dys):
            reduced = [_allreduce(g, op=Average, process_set=process_set) for g in dys]
            return [_my_rows(g, x, process_set) for g, x in zip(reduced, xs)]
        return forward(*xs), grad

    return list(gathered(*tensors))


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    name = None if name is None else f"{name}.0"
    return grouped_allgather([tensor], name, ignore_name_scope, process_set)[0]


# -- broadcast ------------------------------------------------------------------------------

def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """``root_rank``'s value (a global rank, also inside a process set)."""
    state = state_of(process_set)
    C._set_root(state, root_rank)
    tensor = tf.convert_to_tensor(tensor)

    def body(a):
        out = C.synchronize(C.broadcast_async(to_torch(a, False), root_rank, name, process_set))
        return [to_numpy(out, a.dtype)]

    def forward(x):
        return run(body, [x], [x.dtype], [x.shape], "mpilearn_broadcast")[0]

    def backward(dy):
        reduced = _allreduce(dy, op=Average, process_set=process_set)
        return reduced if state.ranks[state.rank] == root_rank else reduced * 0

    return _with_grad(tensor, forward, backward)


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Assign ``root_rank``'s values to ``variables`` in place (one graph op for all of them,
    their broadcasts in flight together); returns them."""
    C._set_root(state_of(process_set), root_rank)
    variables = list(variables)
    if not variables:
        return variables

    def body(*arrays):
        handles = [C.broadcast_async(to_torch(a, False), root_rank, _member_name(name, i),
                                     process_set) for i, a in enumerate(arrays)]
        return [to_numpy(C.synchronize(h), a.dtype) for h, a in zip(handles, arrays)]

    values = run(body, [tf.convert_to_tensor(v) for v in variables],
                 [tf.as_dtype(v.dtype) for v in variables], [v.shape for v in variables],
                 "mpilearn_broadcast")
    for v, value in zip(variables, values):
        v.assign(value)
    return variables


# -- alltoall -------------------------------------------------------------------------------

def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set):
    """Rows scattered by ``splits`` (equal parts without) and the rows received gathered;
    with ``splits`` also the received splits."""
    state_of(process_set)
    tensor = tf.convert_to_tensor(tensor)
    splits_t = (tf.constant([], tf.int32) if splits is None
                else tf.cast(tf.convert_to_tensor(splits), tf.int32))
    given = splits is not None

    def body(a, s):
        out, received = C.synchronize(C.alltoall_async(to_torch(a, False),
                                                       s if given else None, name, process_set))
        return [to_numpy(out, a.dtype), received.numpy().astype(np.int32)]

    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:]) if tensor.shape.rank else None

    def forward(x):
        return run(body, [x, splits_t], [x.dtype, tf.int32], [shape, [None]], "mpilearn_alltoall")

    if not _differentiable(tensor):
        out, received = forward(tensor)
    else:
        @tf.custom_gradient
        def op(x):
            out, received = forward(x)

            def grad(dy, _unused=None):
                return alltoall(dy, splits=received, process_set=process_set)[0]
            return (out, received), grad

        out, received = op(tensor)
    return (out, received) if given else out


# -- reducescatter --------------------------------------------------------------------------

def _reducescatter(tensor, name=None, op=Sum, process_set=global_process_set,
                   prescale_factor=1.0, postscale_factor=1.0):
    op = _check_op(op)
    state = state_of(process_set)
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        raise ValueError("reducescatter needs a tensor of at least one dimension")

    def body(a):
        out = C.synchronize(C.reducescatter_async(to_torch(a, True), name, op, process_set,
                                                  prescale_factor, postscale_factor))
        return [to_numpy(out, a.dtype)]

    def forward(x):
        shape = tf.TensorShape([None]).concatenate(x.shape[1:])
        return run(body, [x], [x.dtype], [shape], "mpilearn_reducescatter")[0]

    def backward(dy):
        factor = (state.size if op == Sum else 1) * prescale_factor * postscale_factor
        return allgather(dy * factor if factor != 1 else dy, process_set=process_set)

    return _with_grad(tensor, forward, backward)


def join():
    """This rank has no more data (see ``mpilearn.torch.join``); the last rank to join."""
    with _lock():
        return tf.constant(C.join(), dtype=tf.int32)


def barrier(process_set=global_process_set):
    with _lock():
        C.barrier(process_set)


def _lock():
    from .bridge import _LOCK

    return _LOCK
