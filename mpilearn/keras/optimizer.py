"""Gradient averaging for Keras 3 optimizers (TensorFlow and torch backends).

Gradients are averaged over the ranks in one fused buffer, through the same allreduce
backend as the torch path, before the Keras optimizer applies them. This works in a custom
loop (GradientTape, or ``loss.backward()`` on the torch backend) and under ``model.fit()``,
including TensorFlow's compiled train step: there the allreduce is a ``tf.numpy_function``,
which XLA cannot compile, so our callbacks turn ``jit_compile`` off (it is off on CPU-only
TensorFlow anyway).
"""
from __future__ import annotations

import time
from typing import List

import keras
import numpy as np

from ..core import comm as _comm
from ..allreduce.noise import NoiseScale
from ..core.flat import reduce_tensors
from ..torch.basics import global_process_set, state_of
from ..torch.compression import Compression
from ..torch.engine import Average
from ..torch.optimizer import check_arguments


def backend_name() -> str:
    name = keras.backend.backend()
    if name not in ("tensorflow", "torch"):
        raise NotImplementedError(f"mpilearn.keras supports the tensorflow and torch backends, "
                                  f"not {name!r}")
    return name


def comm_of(comm=None, process_set=global_process_set):
    if comm is not None:
        return comm
    try:
        return state_of(process_set).comm
    except ValueError:  # mpilearn.init() (not the Horovod-shaped one) was used
        return _comm.context().comm


def broadcast_variables(variables, root_rank=0, comm=None) -> None:
    """Assign root's values to ``variables`` (weights, optimizer slots) on every rank."""
    comm = comm_of(comm)
    for v in variables:
        value = np.array(keras.ops.convert_to_numpy(v), copy=True).reshape(-1)  # owns its data
        comm.Bcast(value.view(np.uint8), root=root_rank)
        v.assign(value.reshape(v.shape))


def _fused_allreduce_(flat, comm, average: bool, prescale: float = 1.0, postscale: float = 1.0):
    """In place on a flat torch tensor: the fused-buffer backend of mpilearn.torch."""
    from ..torch.optimizer import get_backend

    if prescale != 1.0:
        flat *= prescale
    backend = get_backend("mpi", comm, str(flat.device))
    backend.wait(backend.allreduce_async(flat))
    scale = postscale / comm.Get_size() if average else postscale
    if scale != 1.0:
        flat *= scale


def allreduce_arrays(arrays: List[np.ndarray], comm=None, average: bool = True,
                     wire_dtype=None, prescale: float = 1.0, postscale: float = 1.0) -> List[np.ndarray]:
    """Sum or mean of each array over the ranks, sent as one buffer; dtypes are kept.
    ``wire_dtype`` (e.g. float16 for Compression.fp16) is what the values travel as."""
    import torch

    comm = comm_of(comm)
    arrays = [np.asarray(a) for a in arrays]
    if not arrays:
        return arrays
    # float64 stays float64, everything else travels as float32 (or as ``wire_dtype``)
    sent = [torch.from_numpy(np.ascontiguousarray(
        a, dtype=wire_dtype or (np.float64 if a.dtype == np.float64 else np.float32)))
        for a in arrays]
    if comm.Get_size() > 1 or wire_dtype is not None or prescale != 1.0 or postscale != 1.0:
        sent = reduce_tensors(sent, lambda flat: _fused_allreduce_(flat, comm, average,
                                                                     prescale, postscale))
    return [t.numpy().reshape(a.shape).astype(a.dtype) for t, a in zip(sent, arrays)]


_graph_seconds = 0.0  # allreduce time inside compiled graphs (their Python bodies time it)


def _measured(noise, comm, average: bool, scale: float, local: list, reduced: list) -> None:
    """The noise scale's step (``allreduce/noise.py``): the ranks' local squared norms, summed
    by one scalar allreduce, beside the reduced gradient's (contributions g_i/N, the mean)."""
    size = comm.Get_size()
    if noise is None or size < 2:
        return
    sq = sum(float(np.square(np.asarray(a, dtype=np.float64)).sum()) for a in local)
    summed = comm.allreduce(sq / size ** 2)
    unscale = scale * (1.0 if average else size)
    big = sum(float(np.square(np.asarray(a, dtype=np.float64)).sum()) for a in reduced) / unscale ** 2
    noise.record(size, summed, big)


def allreduce_tensors(grads: list, comm, average: bool = True, wire_dtype=None,
                      prescale: float = 1.0, postscale: float = 1.0, noise=None) -> list:
    """Backend tensors in, backend tensors out; inside a tf.function as well. ``noise``: a
    ``NoiseScale`` that records the step's squared norms (no preconditioning: raw only)."""
    plain = wire_dtype is None and prescale == 1.0 and postscale == 1.0
    if comm.Get_size() == 1 and plain:
        return grads
    if backend_name() == "torch":
        import torch

        def reduce_(flat):
            _fused_allreduce_(flat, comm, average, prescale, postscale)

        if noise is not None and wire_dtype is None:
            local = [g.detach().cpu().numpy() for g in grads]
            out = reduce_tensors([g.detach() for g in grads], reduce_)
            _measured(noise, comm, average, prescale * postscale, local,
                      [o.cpu().numpy() for o in out])
            return out

        if wire_dtype is None:
            return reduce_tensors([g.detach() for g in grads], reduce_)
        wire = getattr(torch, np.dtype(wire_dtype).name)
        out = reduce_tensors([g.detach().to(wire) for g in grads], reduce_)
        return [o.to(g.dtype) for o, g in zip(out, grads)]
    import tensorflow as tf

    def reduce(*arrays):  # runs when the graph runs: its time is the allreduce's
        global _graph_seconds
        start = time.perf_counter()
        out = allreduce_arrays(list(arrays), comm, average, wire_dtype, prescale, postscale)
        _measured(noise, comm, average, prescale * postscale, arrays, out)
        _graph_seconds += time.perf_counter() - start
        return out

    dense = [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices -> dense
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(a) for a in reduce(*[g.numpy() for g in dense])]
    out = tf.numpy_function(reduce, dense, [g.dtype for g in dense], stateful=True,
                            name="mpilearn_allreduce")
    for o, g in zip(out, dense):
        o.set_shape(g.shape)
    return list(out)


NONFINITE = "non-finite gradients, step skipped"


def _checked_finite(grads) -> list:
    """``grads``, checked to be finite before they are applied: eagerly a TrainingStopped;
    inside a compiled TensorFlow graph an assertion op that the apply depends on (its
    InvalidArgumentError carries :data:`NONFINITE`; the caller turns it into the stop)."""
    if backend_name() == "tensorflow":
        import tensorflow as tf

        if not tf.executing_eagerly():
            return [None if g is None else tf.debugging.assert_all_finite(g, NONFINITE)
                    for g in grads]
    if all(bool(np.isfinite(keras.ops.convert_to_numpy(g)).all()) for g in grads if g is not None):
        return grads
    from ..errors import TrainingStopped

    raise TrainingStopped(f"{NONFINITE} (Keras update)")


class _DistributedMixin:
    """Mixed into the user's optimizer class: ``apply`` reduces the gradients first; with
    ``backward_passes_per_step`` > 1 it accumulates them locally and applies every N-th call."""

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if self._mpilearn_passes > 1:
            grads = self._accumulate(grads)
            if grads is None:
                return None
        start = time.perf_counter()
        present = [i for i, g in enumerate(grads) if g is not None]
        cfg = self._mpilearn
        reduced = allreduce_tensors([grads[i] for i in present], cfg["comm"], cfg["average"],
                                    cfg["wire"], cfg["prescale"], cfg["postscale"],
                                    getattr(self, "_noise", None))
        for i, g in zip(present, reduced):
            grads[i] = g
        # time of the averaging (eager calls; under a compiled fit() it is part of the graph)
        self._mpilearn_seconds = getattr(self, "_mpilearn_seconds", 0.0) + time.perf_counter() - start
        if getattr(self, "_mpilearn_guard", False):
            # the averaged gradients are alike on every rank: every rank stops here, unapplied
            grads = _checked_finite(grads)
        return super().apply(grads, trainable_variables)

    def _accumulate(self, grads):
        """Eager accumulation over backward_passes_per_step calls (Horovod's local gradient
        aggregation); returns the aggregate on the N-th call, else None."""
        if backend_name() == "tensorflow":
            import tensorflow as tf

            if not tf.executing_eagerly():
                raise NotImplementedError(
                    "backward_passes_per_step > 1 needs eager execution on TensorFlow: compile "
                    "with run_eagerly=True (or use the torch backend)")
        arrays = [None if g is None else np.asarray(keras.ops.convert_to_numpy(g)) for g in grads]
        acc = self._mpilearn_acc
        self._mpilearn_acc = arrays if acc is None else [
            a if b is None else (b if a is None else a + b) for a, b in zip(arrays, acc)]
        self._mpilearn_count += 1
        if self._mpilearn_count < self._mpilearn_passes:
            return None
        total, self._mpilearn_acc, self._mpilearn_count = self._mpilearn_acc, None, 0
        if self._mpilearn_average_aggregated:
            total = [None if t is None else t / self._mpilearn_passes for t in total]
        return [None if t is None else keras.ops.convert_to_tensor(t) for t in total]

    @property
    def allreduce_seconds(self) -> float:
        """Averaging time since the last call (the compiled graphs' too, counted once)."""
        global _graph_seconds
        seconds, self._mpilearn_seconds = getattr(self, "_mpilearn_seconds", 0.0), 0.0
        seconds, _graph_seconds = seconds + _graph_seconds, 0.0
        return seconds


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True, *,
                         comm=None, noise_scale: bool = True):
    """Wrap a Keras optimizer so that it applies gradients averaged (or summed) over the
    ranks (``horovod.tensorflow.keras`` arguments; ``comm`` and ``noise_scale`` are
    mpilearn's: an explicit communicator, and measuring the gradient noise scale, read with
    ``mpilearn.keras.callbacks.NoiseScaleCallback`` or ``optimizer._noise.estimate``). The
    object stays an instance of the user's optimizer class. ``device_*``,
    ``sparse_as_dense``, groups and ``scale_local_gradients`` are accepted for compatibility:
    all gradients travel dense, in one fused buffer."""
    backend_name()
    check_arguments(op, gradient_predivide_factor, backward_passes_per_step)
    if compression is Compression.bf16:
        raise ValueError("Compression.bf16 is not available for Keras (numpy has no bfloat16); "
                         "use Compression.fp16")
    if compression not in (Compression.none, Compression.fp16):
        raise ValueError("mpilearn.keras supports Compression.none and Compression.fp16")
    base = optimizer.__class__
    # same module and name as the base, so saved models carry the plain optimizer
    optimizer.__class__ = type(base.__name__, (_DistributedMixin, base),
                               {"__module__": base.__module__, "__qualname__": base.__qualname__})
    prescale, postscale = 1.0, 1.0
    if gradient_predivide_factor != 1.0:
        prescale, postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
    wire = {Compression.fp16: np.float16}.get(compression)
    optimizer._mpilearn = {"comm": comm_of(comm, process_set), "average": op == Average,
                           "wire": wire, "prescale": prescale, "postscale": postscale}
    optimizer._mpilearn_passes = backward_passes_per_step
    optimizer._mpilearn_average_aggregated = average_aggregated_gradients
    optimizer._mpilearn_acc, optimizer._mpilearn_count = None, 0
    optimizer._noise = NoiseScale(None) if noise_scale else None
    return optimizer
