"""Finite-gradient guards that cost one host sync per batch.

Reading a device value (``bool(t)``, ``.item()``, ``.cpu()``) waits for the device to finish
everything queued so far, so each read stalls the pipeline. A training step therefore reads
its device values once, through :func:`read_host` (which counts the reads, for the tests):
the finite flags of its updates and its loss values in one tensor.

* :func:`guarded_step`: one update, its flag and values read together *before* ``step()``
  (a supervised task): a non-finite step is never applied.
* :func:`flagged_step` + :class:`Snapshot`: several dependent updates per batch (the 3DGAN's
  four) step without reading; the batch's flags and losses are read once at its end, and a
  non-finite batch is undone from the snapshot taken at its start before anything (a
  checkpoint, the next batch) sees it. Either way the weights a run keeps are a good step's.
"""
from __future__ import annotations

import itertools
from typing import Iterable, Sequence

import numpy as np
import torch

from ..errors import TrainingStopped

READS = {"count": 0}  # host reads made through read_host, since the process started


def read_host(tensor: torch.Tensor) -> np.ndarray:
    """The step's one device-to-host read (float64 numpy)."""
    READS["count"] += 1
    return tensor.detach().to(torch.float64).cpu().numpy()


def finite_flag(optimizer) -> torch.Tensor:
    """A 0-dim bool tensor, on the device: the gradients ``step()`` would apply are finite
    (a DistributedOptimizer's after averaging: the same on every rank)."""
    reducer = getattr(optimizer, "_reducer", None)
    if reducer is not None:
        return reducer.finite_flag()
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not grads:
        return torch.ones((), dtype=torch.bool)
    return torch.stack([torch.isfinite(g).all() for g in grads]).all()


def _synchronize(optimizer) -> None:
    if hasattr(optimizer, "skip_synchronize"):
        optimizer.synchronize()


def _step(optimizer) -> None:
    if hasattr(optimizer, "skip_synchronize"):
        with optimizer.skip_synchronize():
            optimizer.step()
    else:
        optimizer.step()


def guarded_step(optimizer, context: str = "", values=None) -> np.ndarray:
    """``optimizer.step()`` only on finite gradients, checked in the same host read as
    ``values`` (a tensor, e.g. the loss); returns ``values`` on the host."""
    _synchronize(optimizer)
    flag = finite_flag(optimizer)
    values = torch.zeros(0) if values is None else values.detach().reshape(-1)
    host = read_host(torch.cat([flag.reshape(1).to(values.device, torch.float64),
                                values.to(torch.float64)]))
    if not host[0]:
        shown = f"; values {host[1:].tolist()}" if len(host) > 1 else ""
        raise TrainingStopped(f"non-finite gradients, step skipped ({context}{shown})")
    _step(optimizer)
    return host[1:]


def flagged_step(optimizer) -> torch.Tensor:
    """``optimizer.step()`` without reading anything; returns the finite flag (device) for
    the batch's one read. The caller must hold a :class:`Snapshot` to undo a bad batch."""
    _synchronize(optimizer)
    flag = finite_flag(optimizer)
    _step(optimizer)
    return flag


class Snapshot:
    """The models' parameters and buffers and the optimizers' state, copied on the device
    (a few MiB for the 3DGAN: microseconds on a GPU), so that ``restore()`` undoes a batch."""

    def __init__(self, models: Iterable[torch.nn.Module], optimizers: Sequence):
        self.live = [t for m in models for t in itertools.chain(m.parameters(), m.buffers())]
        with torch.no_grad():
            self.saved = [t.detach().clone() for t in self.live]
        self.states = [(opt, {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                              for p, s in opt.state.items()}) for opt in optimizers]

    def restore(self) -> None:
        with torch.no_grad():
            for t, s in zip(self.live, self.saved):
                t.copy_(s)
        for opt, state in self.states:
            opt.state.clear()
            opt.state.update(state)
