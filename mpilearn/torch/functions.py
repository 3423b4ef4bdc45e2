"""Parameters, optimizer state and Python objects across ranks (``horovod.torch.functions``)."""
from __future__ import annotations

import io
import pickle

import torch

from . import collectives as C
from .basics import global_process_set, state_of


def _dumps(obj) -> bytes:
    try:  # like Horovod: lambdas and local classes travel too
        import cloudpickle

        return cloudpickle.dumps(obj)
    except ImportError:
        return pickle.dumps(obj)


def broadcast_parameters(params, root_rank, process_set=global_process_set, comm=None) -> None:
    """Overwrite, in place, every rank's tensors with those of ``root_rank``: a
    ``state_dict()``, ``named_parameters()``, ``parameters()`` or a list of tensors."""
    if isinstance(params, dict):
        params = sorted(params.items())
    elif isinstance(params, (list, tuple)) or hasattr(params, "__next__"):
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = [C.broadcast_async_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank,
                                  name, process_set, comm)
               for name, p in params if torch.is_tensor(p)]
    for h in handles:
        C.synchronize(h)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set, comm=None):
    """``root_rank``'s object on every rank (pickled; cloudpickle when installed)."""
    state = state_of(process_set, comm)
    root = C._set_root(state, root_rank)
    payload = _dumps(obj) if state.rank == root else None
    payload = state.sync.bcast(payload, root=root)
    return obj if state.rank == root else pickle.load(io.BytesIO(payload))


def allgather_object(obj, name=None, process_set=global_process_set, comm=None) -> list:
    """Every rank's object, in rank order."""
    state = state_of(process_set, comm)
    return [pickle.loads(b) for b in state.sync.allgather(_dumps(obj))]


def broadcast_optimizer_state(optimizer, root_rank, model=None, process_set=global_process_set,
                              comm=None) -> None:
    """Every rank's optimizer takes root's state and hyperparameters (moments, steps, lr);
    any optimizer whose ``state_dict`` loads back, LBFGS included."""
    state = state_of(process_set, comm)
    root = C._set_root(state, root_rank)
    if not optimizer.state_dict()["state"]:
        # like Horovod, an optimizer that has not stepped yet leaves with zero gradients on
        # the parameters that take gradients (the state itself is created by the first step)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
    sd = _to_cpu(optimizer.state_dict()) if state.rank == root else None
    sd = broadcast_object(sd, root_rank, process_set=process_set, comm=comm)
    if state.rank != root:
        optimizer.load_state_dict(sd)


def _to_cpu(obj):
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set, comm=None):
    """A sparse COO tensor reduced as Horovod does it: its indices and values allgathered
    (duplicates summed when used), values divided by the set size for Average. Returns a
    callable that waits and gives the reduced sparse tensor."""
    from .engine import Average

    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    # allgather concatenates along the first dimension: indices travel as (nnz, ndim)
    indices = C.allgather_async(t._indices().transpose(0, 1).contiguous(), f"{name}.indices",
                                process_set, comm)
    values = C.allgather_async(t._values(), f"{name}.values", process_set, comm)
    n = state_of(process_set, comm).size

    def handle():
        v, i = C.synchronize(values), C.synchronize(indices)
        if op == Average:
            v = v / n
        return torch.sparse_coo_tensor(i.transpose(0, 1), v, t.size())
    return handle
