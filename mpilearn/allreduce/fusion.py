"""Tensor fusion with overlap: gradients are packed into a few flat buffers and each buffer's
allreduce starts as soon as backward has produced all its gradients.

Buckets are built in reverse parameter order (the order backward produces gradients) up to a
byte threshold, and are launched strictly in bucket order, so every rank issues the same
collectives in the same order whatever the timing of its hooks.
"""
from __future__ import annotations

import time
from typing import Iterable, List

import torch


class Bucket:
    def __init__(self, params: List[torch.nn.Parameter]):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        ref = params[0]
        self.buffer = torch.zeros(self.numel, dtype=ref.dtype, device=ref.device)
        self.ready = 0
        self.handle = None

    def pack(self) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            if p.grad is None:  # no gradient on this rank: it still takes part, with zeros
                self.buffer[offset:offset + n].zero_()
            else:
                self.buffer[offset:offset + n].copy_(p.grad.reshape(-1))
            offset += n

    def unpack(self, scale: float) -> None:
        if scale != 1.0:
            self.buffer.mul_(scale)
        offset = 0
        for p in self.params:
            n = p.numel()
            view = self.buffer[offset:offset + n].view_as(p)
            if p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)
            offset += n


def make_buckets(params: Iterable[torch.nn.Parameter], threshold_bytes: int) -> List[Bucket]:
    buckets, current, size = [], [], 0
    for p in reversed(list(params)):
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
    """Averages (or sums) the gradients of ``params`` across the ranks of ``backend``."""

    def __init__(self, params, backend, size: int, threshold_bytes: int = 25 << 20,
                 average: bool = True):
        self.params = [p for p in params if p.requires_grad]
        # the same parameter object must not be reduced twice (tied weights)
        seen, unique = set(), []
        for p in self.params:
            if id(p) not in seen:
                seen.add(id(p))
                unique.append(p)
        self.params = unique
        self.backend = backend
        self.scale = 1.0 / size if average else 1.0
        self.buckets = make_buckets(self.params, threshold_bytes)
        self._bucket_of = {}
        for b in self.buckets:
            for p in b.params:
                self._bucket_of[id(p)] = b
        self._next = 0  # index of the next bucket to launch
        self._hooks = []
        self.seconds = 0.0  # time spent in communication calls and waits, since last reset

    # -- overlap with backward ------------------------------------------------------------
    def attach_hooks(self) -> None:
        for p in self.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def detach_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _on_grad(self, p) -> None:
        bucket = self._bucket_of[id(p)]
        if bucket.handle is not None:
            raise RuntimeError("a gradient was accumulated again after its allreduce started: "
                               "call optimizer.step() (or synchronize()) after each backward")
        bucket.ready += 1
        self._launch_ready()

    def _launch(self, bucket: Bucket) -> None:
        start = time.perf_counter()
        bucket.pack()
        bucket.handle = self.backend.allreduce_async(bucket.buffer)
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
        """Launch what backward did not (missing gradients count as zeros), wait, average."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        start = time.perf_counter()
        for bucket in self.buckets:
            self.backend.wait(bucket.handle)
            bucket.unpack(self.scale)
            bucket.handle = None
            bucket.ready = 0
        self._next = 0
        self.seconds += time.perf_counter() - start

    def all_finite(self) -> bool:
        return all(bool(torch.isfinite(b.buffer).all()) for b in self.buckets)

    def pop_seconds(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s
