"""The one flat-buffer type: tensors of one dtype and device laid end to end in one buffer.

Every fused exchange goes through it: the gradient buckets of the allreduce
(:mod:`mpilearn.allreduce.fusion`), the asynchronous master/worker messages
(:mod:`mpilearn.train.asyncsgd`, with an int64 header in front of the payload), the local-SGD
parameter average and the Keras gradient allreduce. ``views()`` are slices of the buffer
shaped like the tensors, so reading a result needs no copy.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch


class FlatBuffer:
    """``tensors`` (one dtype, one device) as one contiguous ``payload``. With ``header`` > 0
    the buffer is a host message: ``header`` int64 slots, then the payload, in one byte array
    (``message``) that MPI sends as it is."""

    def __init__(self, tensors: Sequence[torch.Tensor], header: int = 0,
                 dtype: Optional[torch.dtype] = None):
        self.tensors = list(tensors)
        ref = self.tensors[0] if self.tensors else torch.empty(0)
        self.dtype = dtype or ref.dtype
        self.sizes = [t.numel() for t in self.tensors]
        self.numel = sum(self.sizes)
        if header:
            itemsize = torch.empty(0, dtype=self.dtype).element_size()
            self.message = np.zeros(header * 8 + self.numel * itemsize, dtype=np.uint8)
            self.header = self.message[:header * 8].view(np.int64)
            self.payload = torch.from_numpy(self.message[header * 8:]).view(self.dtype)
        else:
            self.message = self.header = None
            self.payload = torch.zeros(self.numel, dtype=self.dtype, device=ref.device)

    def views(self) -> List[torch.Tensor]:
        """Slices of the payload shaped like the tensors (no copies)."""
        return [piece.view(t.shape) for piece, t in
                zip(torch.split(self.payload, self.sizes), self.tensors)]

    def pack(self, tensors: Optional[Iterable[Optional[torch.Tensor]]] = None,
             scale: float = 1.0) -> torch.Tensor:
        """Copies ``tensors`` (by default the buffer's own) into the payload; None packs zeros
        (a rank without that gradient still takes part), a sparse tensor packs dense."""
        tensors = self.tensors if tensors is None else tensors
        with torch.no_grad():
            for view, t in zip(torch.split(self.payload, self.sizes), tensors):
                if t is None:
                    view.zero_()
                else:
                    t = t.to_dense() if t.is_sparse else t
                    view.copy_(t.detach().reshape(-1))
            if scale != 1.0:
                self.payload.mul_(scale)
        return self.payload

    def unpack(self, tensors: Optional[Iterable[torch.Tensor]] = None) -> None:
        """Copies the payload back into ``tensors`` (by default the buffer's own)."""
        tensors = self.tensors if tensors is None else tensors
        with torch.no_grad():
            for t, view in zip(tensors, self.views()):
                t.copy_(view)


def by_dtype(tensors: Sequence[torch.Tensor]) -> Dict[tuple, List[int]]:
    """Indices of ``tensors`` grouped by (dtype, device), in first-seen order: one flat buffer
    per group keeps every value in its own precision."""
    groups: Dict[tuple, List[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return groups


def reduce_tensors(tensors: Sequence[torch.Tensor], allreduce_) -> List[torch.Tensor]:
    """``allreduce_(flat)`` (in place) on one flat buffer per dtype; returns the reduced
    values as views shaped like ``tensors``, in their order."""
    out: List[Optional[torch.Tensor]] = [None] * len(tensors)
    for indices in by_dtype(tensors).values():
        flat = FlatBuffer([tensors[i] for i in indices])
        allreduce_(flat.pack())
        for i, view in zip(indices, flat.views()):
            out[i] = view
    return out
