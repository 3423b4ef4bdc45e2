"""Tensor fusion with overlap: gradients are packed into a few flat buffers and each buffer's
allreduce starts as soon as backward has produced all its gradients.

Buckets are built in reverse parameter order (the order backward produces gradients) up to a
byte threshold, and are launched strictly in bucket order, so every rank issues the same
collectives in the same order whatever the timing of its hooks.
"""
from __future__ import annotations

import time
from typing import Iterable, List, Optional

import torch

from ..flat import FlatBuffer


class Bucket(FlatBuffer):
    """Parameters whose gradients travel together: the flat buffer of their gradients."""

    def __init__(self, params: List[torch.nn.Parameter]):
        super().__init__(params)
        self.params = params
        self.buffer = self.payload
        self.ready = 0
        self.handle = None

    def pack(self, scale: float = 1.0) -> None:
        super().pack([p.grad for p in self.params], scale)

    def unpack(self, scale: float, source=None, keep_sparse: bool = False) -> None:
        source = self.buffer if source is None else source
        if scale != 1.0:
            source.mul_(scale)
        for p, view in zip(self.params, torch.split(source, self.sizes)):
            view = view.view_as(p)
            if p.grad is None:
                p.grad = view.to(p.dtype, copy=True)
            elif p.grad.is_sparse:
                p.grad = view.to(p.dtype).to_sparse() if keep_sparse else view.to(p.dtype, copy=True)
            else:
                p.grad.copy_(view)


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
    buckets; ``prescale``/``postscale`` multiply before and after the reduction."""

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
        self.prescale = prescale
        self.scale = (postscale / size) if average else postscale
        self.compression = compression
        self.backward_passes = backward_passes
        self.sparse_as_dense = sparse_as_dense
        self.buckets = make_buckets(self.params, threshold_bytes, groups)
        self._bucket_of = {}
        for b in self.buckets:
            for p in b.params:
                self._bucket_of[id(p)] = b
        self._delay = {id(p): backward_passes for p in self.params}
        self._next = 0  # index of the next bucket to launch
        self._hooks = []
        self.seconds = 0.0  # time spent in communication calls and waits, since last reset

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
        self._delay[id(p)] -= 1
        if self._delay[id(p)] == 0:
            self._bucket_of[id(p)].ready += 1
            self._launch_ready()

    def _launch(self, bucket: Bucket) -> None:
        start = time.perf_counter()
        bucket.pack(self.prescale)
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

    # -- completion -----------------------------------------------------------------------
    def synchronize(self) -> None:
        """Launch what backward did not (missing gradients count as zeros), wait, scale."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        start = time.perf_counter()
        for bucket in self.buckets:
            handle, sent, ctx = bucket.handle
            self.backend.wait(handle)
            source = None
            if self.compression is not None:
                source = self.compression.decompress(sent, ctx)
            bucket.unpack(self.scale, source, keep_sparse=not self.sparse_as_dense)
            bucket.handle = None
            bucket.ready = 0
        self._next = 0
        self._delay = {k: self.backward_passes for k in self._delay}
        self.seconds += time.perf_counter() - start

    def reset(self) -> None:
        """Forget partial accumulation (after load_state_dict)."""
        for b in self.buckets:
            b.ready, b.handle = 0, None
        self._next = 0
        self._delay = {k: self.backward_passes for k in self._delay}

    def all_finite(self) -> bool:
        return all(bool(torch.isfinite(b.buffer).all()) for b in self.buckets)

    def pop_seconds(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s
