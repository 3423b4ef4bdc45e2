"""Batch normalisation over the global batch: the statistics are reduced over the process set
with the differentiable allreduce, so autograd gives the exact global-batch gradients."""
from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .autograd import allreduce
from .basics import global_process_set
from .engine import Sum


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm{1,2,3}d`` (any input of shape (N, C, ...)); in
    training, mean and variance are those of all ranks' batches together. Works on CPU and
    GPU (Horovod's needs a GPU)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_set=global_process_set, comm=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set, self.comm = process_set, comm

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _factor(self) -> float:
        if self.momentum is not None:
            return self.momentum
        return 1.0 / float(self.num_batches_tracked)

    def forward(self, input):
        self._check_input_dim(input)
        if not (self.training or not self.track_running_stats):
            return super().forward(input)
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        dims = [0] + list(range(2, input.dim()))
        count = torch.tensor([input.numel() / max(input.shape[1], 1)], dtype=input.dtype,
                             device=input.device)
        local = torch.cat([input.sum(dims), count])
        total = allreduce(local, op=Sum, process_set=self.process_set, comm=self.comm)
        n = total[-1]
        mean = total[:-1] / n
        shape = [1, -1] + [1] * (input.dim() - 2)
        centred = input - mean.reshape(shape)
        var = allreduce((centred * centred).sum(dims), op=Sum, process_set=self.process_set,
                        comm=self.comm) / n
        if self.training and self.track_running_stats:
            with torch.no_grad():
                f = self._factor()
                unbiased = var * (n / (n - 1)) if n > 1 else var
                self.running_mean.mul_(1 - f).add_(mean.detach() * f)
                self.running_var.mul_(1 - f).add_(unbiased.detach() * f)
        out = centred / torch.sqrt(var.reshape(shape) + self.eps)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out
