"""Gradient averaging for TensorFlow 2 custom loops: ``DistributedGradientTape``,
``DistributedOptimizer`` and ``broadcast_variables`` of ``horovod.tensorflow``.

The tape reduces the gradients it returns: dense ones of one dtype as one fused buffer (per
group with ``num_groups``/``groups``), ``IndexedSlices`` by allgathering values and indices as
Horovod does (or dense with ``sparse_as_dense``). Eager and inside ``tf.function``.
"""
from __future__ import annotations

import warnings

import tensorflow as tf

from ..torch.basics import global_process_set
from ..torch.engine import Adasum, Average, Sum
from .compression import Compression
from .ops import grouped_allreduce


def _key(source):
    """A hashable identity of a tf.Variable, tensor or Keras 3 variable (which has no ref)."""
    return source.ref() if hasattr(source, "ref") else id(source)


def _split(items: list, n: int) -> list:
    """``n`` contiguous groups of nearly equal length (Horovod's split_list)."""
    n = max(1, min(n, len(items)))
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def _groups_of(grads, sources, groups) -> list:
    """Index groups of the non-None gradients, as Horovod forms them."""
    present = [i for i, g in enumerate(grads) if g is not None]
    if groups is None:
        return [present] if present else []
    if isinstance(groups, list):
        by_ref = {_key(sources[i]): i for i in present}
        out = []
        for group in groups:
            idx = [by_ref.pop(_key(v)) for v in group if _key(v) in by_ref]
            if idx:
                out.append(idx)
        return out + [[i] for i in present if _key(sources[i]) in by_ref]
    return [g for g in _split(present, groups) if g]


def make_allreduce_grads(compression, sparse_as_dense, op, gradient_predivide_factor,
                         groups, process_set, comm=None):
    """``reduce(grads, sources) -> grads`` with Horovod's scaling of the average."""
    prescale, postscale = 1.0, 1.0
    if op == Average:
        prescale, postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor

    def reduce(grads, sources):
        grads = list(grads)
        if sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                     for g in grads]
        if comm is None and process_set.included() is False:
            return grads   # not a member of the set: local gradients, as Horovod's cond does
        out = list(grads)
        for idx in _groups_of(grads, sources, groups):
            reduced = grouped_allreduce([grads[i] for i in idx], compression=compression, op=op,
                                        prescale_factor=prescale, postscale_factor=postscale,
                                        process_set=process_set, comm=comm)
            for i, r in zip(idx, reduced):
                out[i] = r
        return out
    return reduce


def _check(op, gradient_predivide_factor, num_groups, groups):
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if op == Adasum:
        raise NotImplementedError("Adasum is not implemented by mpilearn: use op=hvd.Average "
                                  "(or hvd.Sum)")
    if op not in (Average, Sum):
        raise ValueError(f"gradients can be averaged or summed, not reduced with op={op!r}")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                      "removed in v0.23.0.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of "
                         "tf.Variable.")
    return groups


class _DistributedGradientTape:
    """Mixed into the tape's class: ``gradient`` returns reduced gradients."""

    def register_local_source(self, source):
        """A source whose gradient stays local (scaled by 1/size, as Horovod does)."""
        self._mpilearn_local.add(_key(source))

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False):
        flat = tf.nest.flatten(sources)
        grads = list(super().gradient(target, flat, output_gradients))
        local = self._mpilearn_local
        shared = [i for i, s in enumerate(flat) if _key(s) not in local]
        reduced = self._mpilearn_reduce([grads[i] for i in shared], [flat[i] for i in shared])
        for i, g in zip(shared, reduced):
            grads[i] = g
        if local and self._mpilearn_scale_local:
            comm = self._mpilearn_comm
            n = comm.Get_size() if comm is not None else self._mpilearn_set.size()
            for i, s in enumerate(flat):
                g = grads[i]
                if _key(s) in local and g is not None:
                    grads[i] = (tf.IndexedSlices(g.values / n, g.indices, g.dense_shape)
                                if isinstance(g, tf.IndexedSlices) else g / n)
        return tf.nest.pack_sequence_as(sources, grads)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names=False):
        grads = self.gradient(target, sources, output_gradients)
        pairs = list(zip(sources, grads))
        return ([p for p in pairs if _key(p[0]) in self._mpilearn_local],
                [p for p in pairs if _key(p[0]) not in self._mpilearn_local])


def DistributedGradientTape(gradtape, device_dense="", device_sparse="",
                            compression=Compression.none, sparse_as_dense=False, op=Average,
                            gradient_predivide_factor=1.0, num_groups=0, groups=None,
                            process_set=global_process_set, scale_local_gradients=True, *,
                            comm=None):
    """Wrap a ``tf.GradientTape``: its ``gradient`` returns the gradients averaged (or
    summed) over the ranks of ``process_set``, or of ``comm`` (an mpi4py communicator, such
    as a trainer's HPO block: mpilearn's keyword). ``device_*`` are accepted (CPU transport)."""
    groups = _check(op, gradient_predivide_factor, num_groups, groups)
    base = gradtape.__class__
    gradtape.__class__ = type(base.__name__, (_DistributedGradientTape, base), {})
    gradtape._mpilearn_reduce = make_allreduce_grads(compression, sparse_as_dense, op,
                                                     gradient_predivide_factor, groups,
                                                     process_set, comm)
    gradtape._mpilearn_local = set()
    gradtape._mpilearn_set = process_set
    gradtape._mpilearn_comm = comm
    gradtape._mpilearn_scale_local = scale_local_gradients
    return gradtape


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",
                         device_sparse="", compression=Compression.none, sparse_as_dense=False,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """For Keras optimizers (TensorFlow 2 has no other): ``apply_gradients`` applies the
    gradients reduced over the ranks, as ``mpilearn.keras.DistributedOptimizer``."""
    from ..keras import DistributedOptimizer as KerasDistributedOptimizer
    from ..torch.compression import Compression as TorchCompression

    _check(op, gradient_predivide_factor, num_groups, groups)
    if not isinstance(optimizer, tf.keras.optimizers.Optimizer):
        raise ValueError(f"DistributedOptimizer needs a Keras optimizer, got {type(optimizer)} "
                         "(TensorFlow 1 optimizers are not supported)")
    keras_compression = {Compression.none: TorchCompression.none,
                         Compression.fp16: TorchCompression.fp16}.get(compression, compression)
    return KerasDistributedOptimizer(
        optimizer, name=name, compression=keras_compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, process_set=process_set,
        scale_local_gradients=scale_local_gradients)


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Every rank's ``variables`` take ``root_rank``'s values (eager or in a graph)."""
    from .mpi_ops import broadcast_

    return broadcast_(list(variables), root_rank, process_set=process_set)
