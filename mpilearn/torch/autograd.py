"""The blocking collectives of ``horovod.torch``, differentiable with Horovod's gradients:

- allreduce: the gradient is the same allreduce of the gradient;
- allgather: the averaged gradient, narrowed to this rank's rows;
- broadcast: the averaged gradient on the root, zeros elsewhere;
- alltoall: the gradients sent back with the received splits;
- reducescatter: the gathered gradient (times the set size for Sum, and the scale factors).
"""
from __future__ import annotations

import torch

from . import collectives as C
from .basics import global_process_set, state_of
from .compression import Compression
from .engine import Average, Sum


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale, postscale, process_set, comm):
        ctx.args = (average, op, prescale, postscale, process_set, comm)
        return C.synchronize(C.allreduce_async(tensor, average, name, op, prescale, postscale,
                                               process_set, comm))

    @staticmethod
    def backward(ctx, grad):
        average, op, prescale, postscale, process_set, comm = ctx.args
        return (allreduce(grad, average=average, op=op, prescale_factor=prescale,
                          postscale_factor=postscale, process_set=process_set, comm=comm),
                None, None, None, None, None, None, None)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
              comm=None, backend=None):
    """A new tensor: ``tensor`` reduced over the process set (Average unless ``op`` says).
    ``backend`` (mpilearn's) sends a float Sum/Average through a gradient transport instead."""
    if backend not in (None, "mpi"):
        return _through_backend(tensor, C.resolve_op(op, average), comm, backend)
    compressed, cctx = compression.compress(tensor)
    out = _Allreduce.apply(compressed, average, name, op, prescale_factor, postscale_factor,
                           process_set, comm)
    return compression.decompress(out, cctx)


def _through_backend(tensor, op, comm, backend):
    from ..core import comm as _comm
    from .optimizer import get_backend

    if op not in (Average, Sum):
        raise ValueError("backend= supports op=Average or Sum")
    comm = comm if comm is not None else _comm.context().comm
    out = tensor.detach().clone().contiguous()
    b = get_backend(backend, comm, str(out.device))
    b.wait(b.allreduce_async(out.view(-1)))
    if op == Average:
        out /= comm.Get_size()
    return out


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, op, prescale, postscale, process_set, comm, *tensors):
        ctx.args = (average, op, prescale, postscale, process_set, comm)
        return tuple(C.synchronize(grouped_allreduce_async(list(tensors), average, name, op,
                                                           prescale, postscale, process_set, comm)))

    @staticmethod
    def backward(ctx, *grads):
        average, op, prescale, postscale, process_set, comm = ctx.args
        reduced = grouped_allreduce(list(grads), average=average, op=op, prescale_factor=prescale,
                                    postscale_factor=postscale, process_set=process_set, comm=comm)
        return (None,) * 7 + tuple(reduced)


def _member_name(name, i):
    return None if name is None else f"{name}.{i}"


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set, comm=None):
    return C.GroupHandle(C.allreduce_async(t, average, _member_name(name, i), op, prescale_factor,
                                           postscale_factor, process_set, comm)
                         for i, t in enumerate(tensors))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set, comm=None):
    return C.GroupHandle(C.allreduce_async_(t, average, _member_name(name, i), op,
                                            prescale_factor, postscale_factor, process_set, comm)
                         for i, t in enumerate(tensors))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      comm=None):
    pairs = [compression.compress(t) for t in tensors]
    out = _GroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor,
                                  process_set, comm, *[p[0] for p in pairs])
    return [compression.decompress(t, cctx) for t, (_, cctx) in zip(out, pairs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set, comm=None):
    return C.synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                  postscale_factor, process_set, comm))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set, comm):
        ctx.dim, ctx.process_set, ctx.comm = (tensor.shape[0] if tensor.dim() else 1), process_set, comm
        return C.synchronize(C.allgather_async(tensor, name, process_set, comm))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, average=True, process_set=ctx.process_set, comm=ctx.comm)
        return _my_rows(reduced, ctx.dim, ctx.process_set, ctx.comm), None, None, None


def _my_rows(reduced, dim, process_set, comm):
    r = state_of(process_set, comm).rank
    dims = allgather(torch.tensor([dim], dtype=torch.int32), process_set=process_set, comm=comm)
    offset = int(dims[:r].sum())
    return reduced.narrow(0, offset, dim)


def allgather(tensor, name=None, process_set=global_process_set, comm=None):
    """The tensors of all ranks concatenated along the first dimension (which may differ)."""
    return _Allgather.apply(tensor, name, process_set, comm)


def allgather_async(tensor, name=None, process_set=global_process_set, comm=None):
    return C.allgather_async(tensor, name, process_set, comm)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, comm, *tensors):
        ctx.dims = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.process_set, ctx.comm = process_set, comm
        return tuple(C.synchronize(grouped_allgather_async(list(tensors), name, process_set, comm)))

    @staticmethod
    def backward(ctx, *grads):
        reduced = grouped_allreduce(list(grads), average=True, process_set=ctx.process_set,
                                    comm=ctx.comm)
        return (None, None, None) + tuple(_my_rows(g, d, ctx.process_set, ctx.comm)
                                          for g, d in zip(reduced, ctx.dims))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set, comm=None):
    return C.GroupHandle(C.allgather_async(t, _member_name(name, i), process_set, comm)
                         for i, t in enumerate(tensors))


def grouped_allgather(tensors, name=None, process_set=global_process_set, comm=None):
    return list(_GroupedAllgather.apply(name, process_set, comm, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set, comm):
        ctx.root_rank, ctx.process_set, ctx.comm = root_rank, process_set, comm
        return C.synchronize(C.broadcast_async(tensor, root_rank, name, process_set, comm))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, average=True, process_set=ctx.process_set, comm=ctx.comm)
        state = state_of(ctx.process_set, ctx.comm)
        if state.ranks[state.rank] != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set, comm=None):
    """A new tensor holding ``root_rank``'s value (a global rank, also in a process set)."""
    return _Broadcast.apply(tensor, root_rank, name, process_set, comm)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set, comm):
        output, received = C.synchronize(C.alltoall_async(tensor, splits, name, process_set, comm))
        ctx.received, ctx.process_set, ctx.comm = received, process_set, comm
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, *unused):
        back, _ = alltoall(grad, splits=ctx.received, process_set=ctx.process_set, comm=ctx.comm)
        return back, None, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set, comm=None):
    """Rows of ``tensor`` scattered to the ranks by ``splits`` (equal parts without), and the
    rows received from each gathered. With ``splits`` returns (output, received_splits)."""
    return _Alltoall.apply(tensor, splits, name, process_set, comm)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set, comm=None):
    return C.alltoall_async(tensor, splits, name, process_set, comm)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale, postscale, comm):
        ctx.args = (op, process_set, prescale, postscale, comm)
        return C.synchronize(C.reducescatter_async(tensor, name, op, process_set, prescale,
                                                   postscale, comm))

    @staticmethod
    def backward(ctx, grad):
        op, process_set, prescale, postscale, comm = ctx.args
        factor = (state_of(process_set, comm).size if op == Sum else 1) * prescale * postscale
        grad = grad * factor if factor != 1 else grad
        return allgather(grad, process_set=process_set, comm=comm), None, None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0,
                  comm=None):
    """The reduction over the set, split along the first dimension: this rank's part
    (the first ``dim % size`` ranks get one row more)."""
    compressed, cctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor,
                               postscale_factor, comm)
    return compression.decompress(out, cctx)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0, comm=None):
    return C.reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                 postscale_factor, comm)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0, comm=None):
    return C.GroupHandle(C.reducescatter_async(t, _member_name(name, i), op, process_set,
                                               prescale_factor, postscale_factor, comm)
                         for i, t in enumerate(tensors))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0, comm=None):
    return [reducescatter(t, _member_name(name, i), compression, op, process_set,
                          prescale_factor, postscale_factor, comm)
            for i, t in enumerate(tensors)]
