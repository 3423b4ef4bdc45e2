"""Runs the engine of ``mpilearn.torch`` on TensorFlow values, eagerly or inside a graph.

A collective is a Python body over numpy arrays (through torch tensors, which the engine
speaks). Eagerly it runs at once; inside ``tf.function`` it becomes a ``tf.py_function``,
which is stateful, so TensorFlow's automatic control dependencies keep the collectives in
program order (the engine needs every rank to submit them in the same order, and reports a
different order as an error on every rank, never a hang). A lock keeps two graph threads
from driving the engine at once.
"""
from __future__ import annotations

import threading

import numpy as np
import tensorflow as tf
import torch

_LOCK = threading.RLock()
_BF16 = tf.bfloat16.as_numpy_dtype


def to_torch(array: np.ndarray, arithmetic: bool) -> torch.Tensor:
    """A torch tensor of the engine's dtypes: bfloat16 by its bits, uint16 as int16 bits
    (moved as bytes) or as int32 (reduced)."""
    a = np.array(array, copy=True, order="C")
    if a.dtype == _BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if a.dtype == np.uint16:
        return torch.from_numpy(a.astype(np.int32) if arithmetic else a.view(np.int16))
    return torch.from_numpy(a)


def to_numpy(t: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    """Back to the caller's numpy dtype (the inverse of :func:`to_torch`)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BF16)
    a = t.numpy()
    if dtype == np.uint16 and a.dtype == np.int16:
        return a.view(np.uint16)
    return a.astype(dtype, copy=False)


def run(body, inputs, out_dtypes, out_shapes=None, name="mpilearn_collective"):
    """``body(*numpy arrays) -> list of numpy arrays``, on tensors: eagerly, or as a graph op
    with the given output dtypes and (static, possibly partial) shapes."""
    inputs = [tf.convert_to_tensor(x) for x in inputs]

    def locked(*arrays):
        with _LOCK:
            return body(*arrays)

    if tf.executing_eagerly():
        outs = locked(*[x.numpy() for x in inputs])
        return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(outs, out_dtypes)]

    def graph_body(*tensors):
        return [np.asarray(o) for o in locked(*[t.numpy() for t in tensors])]

    outs = tf.py_function(graph_body, inputs, list(out_dtypes), name=name)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    for o, s in zip(outs, out_shapes or [None] * len(outs)):
        if s is not None:
            o.set_shape(s)
    return outs
