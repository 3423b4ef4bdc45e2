"""Horovod-shaped API for PyTorch: ``import mpilearn.torch as hvd`` ports Horovod code.

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())          # or let mpilearn.train bind devices
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

Unlike Horovod, every call takes an optional ``comm`` so the same code runs inside an HPO
block; the default is the communicator given to :func:`init` (COMM_WORLD).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import comm as _comm
from .allreduce import make_backend
from .allreduce.fusion import GradientReducer

Average = "average"
Sum = "sum"

_BACKENDS = {}


def init(comm=None, backend: str = "mpi"):
    ctx = _comm.init(comm)
    _BACKENDS.setdefault("default", backend)
    return ctx


def rank() -> int:
    return _comm.context().rank


def size() -> int:
    return _comm.context().size


def local_rank() -> int:
    return _comm.context().local_rank


def local_size() -> int:
    return _comm.context().local_size


def get_backend(name: Optional[str] = None, comm=None, device: str = "cpu"):
    """One backend object per (name, communicator), created on first use."""
    comm = comm if comm is not None else _comm.context().comm
    name = name or _BACKENDS.get("default", "mpi")
    key = (name, comm.py2f() if hasattr(comm, "py2f") else id(comm), device)
    if key not in _BACKENDS:
        _BACKENDS[key] = make_backend(name, comm, device)
    return _BACKENDS[key]


# -- collectives on single tensors and objects -------------------------------------------

def allreduce(tensor: torch.Tensor, op: str = Average, comm=None, backend: Optional[str] = None,
              name: Optional[str] = None) -> torch.Tensor:
    """Returns a new tensor holding the sum or average of ``tensor`` over the ranks."""
    comm = comm if comm is not None else _comm.context().comm
    out = tensor.detach().clone().contiguous()
    b = get_backend(backend, comm, str(out.device))
    b.wait(b.allreduce_async(out.view(-1)))
    if op == Average:
        out /= comm.Get_size()
    elif op != Sum:
        raise ValueError(f"op must be Average or Sum, not {op!r}")
    return out


def _bcast_tensor_(tensor: torch.Tensor, root_rank: int, comm) -> None:
    """In-place broadcast of any dtype, sent as raw bytes (staged through host for CUDA)."""
    data = tensor.data
    host = data if (not data.is_cuda and data.is_contiguous()) else data.detach().cpu().contiguous()
    comm.Bcast(host.reshape(-1).view(torch.uint8).numpy(), root=root_rank)
    if host is not data:
        data.copy_(host)


def broadcast_parameters(params, root_rank: int = 0, comm=None) -> None:
    """Overwrite parameters/buffers on every rank with those of ``root_rank`` (in place).

    Accepts ``model.state_dict()``, ``model.named_parameters()`` or a list of tensors.
    """
    comm = comm if comm is not None else _comm.context().comm
    items = params.items() if hasattr(params, "items") else params
    for item in items:
        tensor = item[1] if isinstance(item, tuple) else item
        if torch.is_tensor(tensor):
            _bcast_tensor_(tensor, root_rank, comm)


def broadcast_object(obj, root_rank: int = 0, comm=None):
    comm = comm if comm is not None else _comm.context().comm
    return comm.bcast(obj, root=root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              comm=None) -> None:
    """Make every rank's optimizer state (moments, steps, hyperparameters) equal root's."""
    comm = comm if comm is not None else _comm.context().comm
    state = optimizer.state_dict() if comm.Get_rank() == root_rank else None
    state = comm.bcast(_to_cpu(state), root=root_rank)
    optimizer.load_state_dict(state)


def _to_cpu(obj):
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


# -- the optimizer wrapper ---------------------------------------------------------------

class _DistributedMixin:
    """Mixed into the user's optimizer class: gradients are averaged before ``step()``."""

    def _setup_distributed(self, reducer: GradientReducer) -> None:
        self._reducer = reducer
        self._synchronized = False
        reducer.attach_hooks()

    def synchronize(self) -> None:
        """Wait for all gradient allreduces (Horovod name); step() calls it if needed."""
        self._reducer.synchronize()
        self._synchronized = True

    def step(self, closure=None):
        if not self._synchronized:
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def gradients_finite(self) -> bool:
        """Whether the last averaged gradients were all finite (identical on every rank)."""
        return self._reducer.all_finite()

    @property
    def allreduce_seconds(self) -> float:
        return self._reducer.pop_seconds()


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         backend: Optional[str] = None, comm=None, op: str = Average,
                         fusion_threshold_bytes: int = 25 << 20):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    The returned object is still an instance of the user's optimizer class (LR schedulers and
    ``state_dict`` keep working). Gradients are fused into flat buffers of at most
    ``fusion_threshold_bytes`` whose allreduce starts during backward.
    """
    comm = comm if comm is not None else _comm.context().comm
    if named_parameters is not None:
        params = [p for _, p in named_parameters]
    else:
        params = [p for group in optimizer.param_groups for p in group["params"]]
    device = str(params[0].device) if params else "cpu"
    reducer = GradientReducer(params, get_backend(backend, comm, device), comm.Get_size(),
                              fusion_threshold_bytes, average=(op == Average))
    base = optimizer.__class__
    optimizer.__class__ = type(base.__name__, (_DistributedMixin, base), {})
    optimizer._setup_distributed(reducer)
    return optimizer
