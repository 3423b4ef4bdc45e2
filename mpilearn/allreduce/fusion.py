"""Tensor fusion with overlap: gradients live in a few flat buffers (each ``.grad`` is a view
of its bucket, so nothing is packed or unpacked) and each buffer's allreduce starts as soon as
backward has produced all its gradients.

Buckets are built in reverse parameter order (the order backward produces gradients) up to a
byte threshold, and are launched strictly in bucket order, so every rank issues the same
collectives in the same order whatever the timing of its hooks.
"""
from __future__ import annotations

import time
from typing import Iterable, List, Optional

import torch

from ..core.flat import FlatBuffer


def _aliases(grad: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``grad`` is ``view`` itself (or the same memory with the same layout)."""
    return grad is view or (grad.data_ptr() == view.data_ptr() and grad.shape == view.shape
                            and grad.stride() == view.stride() and grad.dtype == view.dtype)


def _dense(t: torch.Tensor) -> bool:
    return any(t.is_contiguous(memory_format=f) for f in (torch.channels_last, torch.channels_last_3d)
               if t.dim() == (4 if f is torch.channels_last else 5))


class Bucket(FlatBuffer):
    """Parameters whose gradients travel together. Their ``.grad`` are views of the bucket's
    flat buffer (like DDP's ``gradient_as_bucket_view``): backward accumulates straight into
    the buffer, the allreduce works on it in place, and the optimizer reads the result where
    it lies, so there is no pack and no unpack. A gradient that is not the view (the first
    backward, after ``zero_grad(set_to_none=True)``, or one the user replaced) is copied in
    once and the view put back in its place; a sparse one is kept sparse (see ``finish``)."""

    def __init__(self, params: List[torch.nn.Parameter]):
        super().__init__(params)
        self.params = params
        self.buffer = self.payload
        # a channels-last parameter's view has its strides (autograd's gradient layout
        # contract), so backward accumulates into it without a layout change
        self.grad_views = [v if p.is_contiguous() or not _dense(p) else v.as_strided(p.shape, p.stride())
                           for v, p in zip(self.views(), params)]
        self.sparse = [False] * len(params)
        self.all_bound = True  # every gradient was its view when gathered (no sparse ones)
        self.ready = 0
        self.handle = None

    def bind(self, i: int) -> None:
        """Makes parameter ``i``'s gradient the view (copying it in when it is not)."""
        p, view = self.params[i], self.grad_views[i]
        grad = p.grad
        if grad is None or grad.is_sparse or _aliases(grad, view):
            return
        with torch.no_grad():
            view.copy_(grad)
        p.grad = view

    def take(self, i: int, grad) -> None:
        """Parameter ``i``'s final gradient ``grad``, which is not its view, into the buffer."""
        view = self.grad_views[i]
        with torch.no_grad():
            if grad is None:
                view.zero_()  # a rank without that gradient still takes part, with zeros
            elif grad.is_sparse:
                self.sparse[i] = True
                view.copy_(grad.to_dense())
            else:
                self.bind(i)
        self.all_bound = False

    def gather(self, scale: float) -> None:
        """Makes the buffer hold this step's gradients, times ``scale``: one multiply of the
        whole buffer (the per-parameter Python cost is an identity check when every gradient
        already is its view, the usual case)."""
        for i, (p, view) in enumerate(zip(self.params, self.grad_views)):
            grad = p.grad
            if grad is not view:
                self.take(i, grad)
        if scale != 1.0:
            with torch.no_grad():
                self.payload.mul_(scale)

    def finish(self, keep_sparse: bool) -> None:
        """After the reduction: every gradient is the reduced view (sparse ones become sparse
        again, as Horovod does also with ``sparse_as_dense``, so that e.g. SparseAdam steps),
        including one the user replaced meanwhile."""
        if not self.all_bound:
            for i, (p, view) in enumerate(zip(self.params, self.grad_views)):
                if self.sparse[i]:
                    p.grad = view.to_sparse() if keep_sparse else view.clone()
                elif p.grad is None or not _aliases(p.grad, view):
                    p.grad = view
        else:  # the user may have replaced one after backward: the reduced value wins
            for p, view in zip(self.params, self.grad_views):
                if p.grad is not view:
                    p.grad = view
        self.clear()

    def clear(self) -> None:
        if not self.all_bound:
            self.sparse = [False] * len(self.params)
        self.all_bound = True
        self.ready, self.handle = 0, None

    def zero(self) -> set:
        """Zeroes the buffer; the ids of the parameters whose gradient is their view (now
        zero), which ``zero_grad`` therefore leaves bound."""
        self.payload.zero_()
        return {id(p) for p, view in zip(self.params, self.grad_views)
                if p.grad is not None and _aliases(p.grad, view)}


def make_buckets(params: Iterable[torch.nn.Parameter], threshold_bytes: int,
                 groups: Optional[List[list]] = None) -> List[Bucket]:
    """Buckets in reverse parameter order up to ``threshold_bytes``; each of ``groups``
    (Horovod's explicit allreduce groups) is a bucket of its own, per dtype and device."""
    params = list(params)
    buckets: List[Bucket] = []
    if groups:
        grouped = {id(p) for g in groups for p in g}
        for g in groups:
            members = [p for p in params if id(p) in {id(q) for q in g}]
            buckets += make_buckets(members, 1 << 62)
        params = [p for p in params if id(p) not in grouped]
    current, size = [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        compatible = not current or (p.dtype == current[0].dtype and p.device == current[0].device)
        if current and (size + nbytes > threshold_bytes or not compatible):
            buckets.append(Bucket(current))
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(Bucket(current))
    return buckets


class GradientReducer:
    """Averages (or sums) the gradients of ``params`` across the ranks of ``backend``, with
    Horovod's optimizer semantics: gradients accumulate locally over ``backward_passes``
    backward passes before their bucket is reduced; ``compression`` is applied to whole
    buckets. The averaging 1/N and Horovod's ``prescale``/``postscale`` factors are folded
    into one multiply of the whole bucket before its reduction (in exact arithmetic
    ``b * sum(a * x) == sum(a * b * x)``; for a power-of-two N it is exact in floating point
    too), so the reduced buffer is the result, with no pass over it afterwards; with op=Sum
    (``average=False``) and no factors there is no multiply at all."""

    def __init__(self, params, backend, size: int, threshold_bytes: int = 25 << 20,
                 average: bool = True, compression=None, backward_passes: int = 1,
                 prescale: float = 1.0, postscale: float = 1.0, groups=None,
                 sparse_as_dense: bool = False):
        self.params = [p for p in params if p.requires_grad]
        # the same parameter object must not be reduced twice (tied weights)
        seen, unique = set(), []
        for p in self.params:
            if id(p) not in seen:
                seen.add(id(p))
                unique.append(p)
        self.params = unique
        self.backend = backend
        self._scales = (prescale, postscale, average)
        self.factor = prescale * ((postscale / size) if average else postscale)
        self.size = size
        self.noise = None  # a noise.NoiseScale: squared norms before and after each reduction
        self.compression = compression
        self.backward_passes = backward_passes
        self.sparse_as_dense = sparse_as_dense
        self.buckets = make_buckets(self.params, threshold_bytes, groups)
        self._bucket_of = {}  # id(parameter) -> (bucket, index in it)
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._bucket_of[id(p)] = (b, i)
        self._delay = {id(p): backward_passes for p in self.params}
        self._next = 0  # index of the next bucket to launch
        self._hooks = []
        self.overlapped = 0  # buckets launched from backward's hooks (overlap), since creation
        self.seconds = 0.0  # time spent in communication calls and waits, since last reset

    def resize(self, backend, size: int) -> None:
        """Reduce over ``backend`` (a new communicator of ``size`` ranks, after a membership
        change) from the next step on; what was in flight is dropped."""
        prescale, postscale, average = self._scales
        self.backend = backend
        self.factor = prescale * ((postscale / size) if average else postscale)
        self.size = size
        for b in self.buckets:
            b.handle = None
        self.reset()

    def layout(self) -> list:
        """What every rank must agree on: bucket sizes and dtypes, in order."""
        return [(b.numel, str(b.buffer.dtype)) for b in self.buckets]

    def set_backward_passes(self, passes: int) -> None:
        self.backward_passes = passes
        self._delay = {k: passes for k in self._delay}

    # -- overlap with backward ------------------------------------------------------------
    def attach_hooks(self) -> None:
        for p in self.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def detach_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def pending(self) -> bool:
        """Whether any gradient was produced since the last synchronize."""
        return any(d != self.backward_passes for d in self._delay.values())

    def _on_grad(self, p) -> None:
        if self._delay[id(p)] <= 0:
            raise AssertionError("Gradients were computed more than backward_passes_per_step "
                                 "times before call to step(). Increase "
                                 "backward_passes_per_step to accumulate gradients locally.")
        left = self._delay[id(p)] - 1
        self._delay[id(p)] = left
        bucket, i = self._bucket_of[id(p)]
        if left:  # more backward passes will accumulate into the view
            bucket.bind(i)
            return
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch_ready()

    def _launch(self, bucket: Bucket) -> None:
        start = time.perf_counter()
        bucket.gather(self.factor)
        if self.noise is not None and self.size > 1:
            self.noise.local(bucket)
        sent, ctx = bucket.buffer, None
        if self.compression is not None:
            sent, ctx = self.compression.compress(bucket.buffer)
        bucket.handle = (self.backend.allreduce_async(sent), sent, ctx)
        self.seconds += time.perf_counter() - start

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if bucket.ready < len(bucket.params):
                break
            self._launch(bucket)
            self._next += 1
            self.overlapped += 1

    def zero_grads(self) -> set:
        """Zeroes every bucket; the ids of the parameters whose gradient stays bound."""
        bound = set()
        for bucket in self.buckets:
            bound |= bucket.zero()
        return bound

    # -- completion -----------------------------------------------------------------------
    def synchronize(self) -> None:
        """Launch what backward did not (missing gradients count as zeros) and wait."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        # the ranks' local squared norms (noise.py): one 2-element allreduce beside the buckets
        sums = self.noise.local_sums() if self.noise is not None and self.size > 1 else None
        sums_handle = self.backend.allreduce_async(sums) if sums is not None else None
        start = time.perf_counter()
        for bucket in self.buckets:
            handle, sent, ctx = bucket.handle
            self.backend.wait(handle)
            if self.compression is not None:
                with torch.no_grad():
                    bucket.buffer.copy_(self.compression.decompress(sent, ctx))
            bucket.finish(keep_sparse=True)  # Horovod: back to sparse, also with sparse_as_dense
        if sums_handle is not None:
            self.backend.wait(sums_handle)
        if self.noise is not None:
            if self.size > 1:
                self.noise.reduced(self.buckets, self.size, sums)
            else:
                self.noise.reduced_one()
        self._next = 0
        self._delay = dict.fromkeys(self._delay, self.backward_passes)
        self.seconds += time.perf_counter() - start

    def reset(self) -> None:
        """Forget partial accumulation (after load_state_dict)."""
        for b in self.buckets:
            b.clear()
        if self.noise is not None:
            self.noise.drop()
        self._next = 0
        self._delay = {k: self.backward_passes for k in self._delay}

    def finite_flag(self) -> torch.Tensor:
        """Whether every bucket is finite, as a 0-dim bool tensor on the device (no read)."""
        flags = [torch.isfinite(b.buffer).all() for b in self.buckets]
        if not flags:
            return torch.ones((), dtype=torch.bool)
        return flags[0] if len(flags) == 1 else torch.stack(flags).all()

    def all_finite(self) -> bool:
        return bool(self.finite_flag())

    def pop_seconds(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s
