"""The collectives of ``horovod.torch`` on tensors: each kind is one ``start`` (post the data
collective, given every member's record) and one ``finish`` (build the result). A rank that
has joined runs the same ``start`` with no local tensor and so contributes zeros or nothing.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch

from ..core import comm as _comm
from . import engine as E
from .basics import global_process_set, state_of
from .engine import (ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, JOIN, REDUCESCATTER, Adasum,
                     Average, Max, Min, Product, Sum)


def resolve_op(op, average) -> int:
    """Horovod's rule for the deprecated ``average`` argument."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        if op not in E.OP_NAMES:
            raise ValueError(f"unknown reduction op {op!r}: use hvd.Average, Sum, Min, Max or Product")
        return op
    if average is not None:
        return Average if average else Sum
    return Average


def _mpi_op(op: int):
    MPI = _comm.mpi()
    return {Average: MPI.SUM, Sum: MPI.SUM, Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD}[op]


def _scale(array: np.ndarray, factor: float) -> np.ndarray:
    """Multiply in place; integers truncate toward zero, as Horovod's scaling does."""
    if factor == 1.0:
        return array
    if np.issubdtype(array.dtype, np.floating):
        array *= factor
        return array
    array[...] = np.trunc(array.astype(np.float64) * factor).astype(array.dtype)
    return array


def _reduction_input(tensor: torch.Tensor, prescale: float) -> np.ndarray:
    """A flat host copy in the dtype MPI reduces, scaled by ``prescale``."""
    work = tensor.detach().to(E.reduction_dtype(tensor.dtype))
    return _scale(np.array(E.host_array(work), copy=True).reshape(-1), prescale)


def _reduced(result: np.ndarray, reduce_op: int, postscale: float, n: int,
             dtype: torch.dtype) -> torch.Tensor:
    """The reduced buffer as a flat tensor of ``dtype``: averaged over ``n`` for Average
    (integers toward zero), times ``postscale``; bool back from its int32 sum."""
    if reduce_op == Average:
        if np.issubdtype(result.dtype, np.integer) and postscale == 1.0:
            result = (np.sign(result) * (np.abs(result) // n)).astype(result.dtype)
        else:
            result = _scale(result, postscale / n)
    else:
        result = _scale(result, postscale)
    value = torch.from_numpy(result)
    return (value != 0) if dtype == torch.bool else value.to(dtype)


def _numpy_dtype(dtype: torch.dtype):
    return torch.empty(0, dtype=dtype).numpy().dtype


def _ref(gathered: np.ndarray) -> np.ndarray:
    return gathered[E.active_rows(gathered)[0]]


def _row_elems(rec: np.ndarray) -> int:
    """Elements per first-dimension row of the tensor a record describes."""
    ndim = int(rec[10])
    if ndim == 0:
        return 1
    if ndim <= E.MAX_DIMS:
        return int(np.prod(rec[12:11 + ndim], dtype=np.int64)) if ndim > 1 else 1
    return int(rec[9] // rec[11]) if rec[11] else 0


def _itemsize(rec: np.ndarray) -> int:
    return torch.empty(0, dtype=E.DTYPES[int(rec[2]) - 1]).element_size()


def _rows(rec: np.ndarray) -> int:
    return int(rec[11]) if rec[10] > 0 else 1


def _submit(state, kind, name, tensor, start, finish, **record):
    rec = E.make_record(kind, name, tensor, **record)
    return E.submit(state, kind, name, rec, start, finish)


# -- allreduce ------------------------------------------------------------------------------

def _reduction_send(gathered: np.ndarray, kind: int, local: Optional[np.ndarray]):
    """(op, what this rank sends) for a reducing collective: its own values, or zeros of the
    others' size when it has joined. Only Sum/Average make sense with joined ranks' zeros."""
    ref = _ref(gathered)
    reduce_op = int(ref[3])
    if (gathered[:, 0] == JOIN).any() and reduce_op not in (Sum, Average):
        raise E.HorovodInternalError(f"{E.OP_NAMES[reduce_op]} {E.KIND_NAMES[kind]} is not "
                                     "supported while some ranks have joined (they contribute "
                                     "zeros)")
    if local is not None:
        return reduce_op, local
    dtype = _numpy_dtype(E.reduction_dtype(E.DTYPES[int(ref[2]) - 1]))
    return reduce_op, np.zeros(int(ref[9]), dtype=dtype)


def _allreduce_start(local: Optional[np.ndarray]):
    def start(op, gathered):
        E.check_records(gathered, ALLREDUCE)
        reduce_op, buf = _reduction_send(gathered, ALLREDUCE, local)
        op.keep = [buf]
        op.buffer = buf
        MPI = _comm.mpi()
        return op.state.data.Iallreduce(MPI.IN_PLACE, buf, op=_mpi_op(reduce_op))
    return start


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set, comm=None,
                     _output=None):
    """In-place asynchronous allreduce; returns a handle for ``poll``/``synchronize``."""
    reduce_op = resolve_op(op, average)
    if reduce_op == Adasum:
        raise NotImplementedError("Adasum is not implemented by mpilearn: use op=hvd.Average "
                                  "(or hvd.Sum)")
    state = state_of(process_set, comm)
    out = tensor if _output is None else _output
    local = _reduction_input(tensor, prescale_factor)

    def finish(o):
        value = _reduced(o.buffer, reduce_op, postscale_factor, state.size, tensor.dtype)
        out.data.copy_(value.reshape(tensor.shape))
        return out

    return _submit(state, ALLREDUCE, name, tensor, _allreduce_start(local), finish,
                   op=reduce_op, prescale=prescale_factor, postscale=postscale_factor)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set, comm=None):
    output = torch.empty_like(tensor)
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                            process_set, comm, _output=output)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set, comm=None):
    return E.synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                          postscale_factor, process_set, comm))


# -- allgather ------------------------------------------------------------------------------

def _refuse_joined(gathered: np.ndarray, kind: int) -> None:
    """Horovod's rule: allgather and broadcast raise on every rank while some have joined
    (the joined ranks raise too, and keep serving)."""
    if (gathered[:, 0] == JOIN).any():
        raise E.HorovodInternalError(f"{E.KIND_NAMES[kind]} is not supported while some ranks "
                                     "have joined (hvd.join)")


def _allgather_start(local: Optional[np.ndarray]):
    def start(op, gathered):
        E.check_records(gathered, ALLGATHER, first_dim_may_differ=True)
        _refuse_joined(gathered, ALLGATHER)
        ref = _ref(gathered)
        row_bytes = _row_elems(ref) * _itemsize(ref)
        counts = [0 if row[0] == JOIN else _rows(row) * row_bytes for row in gathered]
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
        recv = np.empty(int(sum(counts)), dtype=np.uint8)
        send = local if local is not None else np.empty(0, dtype=np.uint8)
        op.keep, op.buffer = [send, recv], recv
        op.total_rows = sum(0 if row[0] == JOIN else _rows(row) for row in gathered)
        MPI = _comm.mpi()
        return op.state.data.Iallgatherv([send, MPI.BYTE], [recv, (counts, displs), MPI.BYTE])
    return start


def allgather_async(tensor, name=None, process_set=global_process_set, comm=None):
    state = state_of(process_set, comm)
    local = np.array(E.raw_bytes(tensor), copy=True)

    def finish(o):
        flat = torch.from_numpy(o.buffer)
        values = flat.view(tensor.dtype) if flat.numel() else torch.empty(0, dtype=tensor.dtype)
        shape = [o.total_rows] + list(tensor.shape[1:])
        return values.reshape(shape).to(tensor.device)

    return _submit(state, ALLGATHER, name, tensor, _allgather_start(local), finish)


# -- broadcast ------------------------------------------------------------------------------

def _set_root(state, root_rank: int) -> int:
    """Horovod's root is a global rank, also inside a process set."""
    if root_rank not in state.ranks:
        raise ValueError(f"broadcast received invalid root rank {root_rank} for provided "
                         "process set")
    return state.ranks.index(root_rank)


def _broadcast_start(local: Optional[np.ndarray]):
    def start(op, gathered):
        E.check_records(gathered, BROADCAST)
        _refuse_joined(gathered, BROADCAST)
        ref = _ref(gathered)
        root = int(ref[5])
        buf = local if local is not None else np.empty(int(ref[9]) * _itemsize(ref), np.uint8)
        op.keep, op.buffer = [buf], buf
        return op.state.data.Ibcast([buf, _comm.mpi().BYTE], root=root)
    return start


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set, comm=None,
                     _output=None):
    state = state_of(process_set, comm)
    root = _set_root(state, root_rank)
    out = tensor if _output is None else _output
    local = np.array(E.raw_bytes(tensor), copy=True)

    def finish(o):
        flat = torch.from_numpy(o.buffer)
        if flat.numel():
            out.data.copy_(flat.view(tensor.dtype).reshape(tensor.shape))
        return out

    return _submit(state, BROADCAST, name, tensor, _broadcast_start(local), finish, root=root)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set, comm=None):
    return broadcast_async_(tensor, root_rank, name, process_set, comm,
                            _output=torch.empty_like(tensor))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set, comm=None):
    return E.synchronize(broadcast_async_(tensor, root_rank, name, process_set, comm))


# -- alltoall -------------------------------------------------------------------------------

def _alltoall_start(local: Optional[np.ndarray], splits: Optional[np.ndarray]):
    def start(op, gathered):
        E.check_records(gathered, ALLTOALL, first_dim_may_differ=True)
        if (gathered[:, 0] == JOIN).any():
            raise E.HorovodInternalError("alltoall is not supported while some ranks have joined")
        ref = _ref(gathered)
        op.row_bytes = _row_elems(ref) * _itemsize(ref)
        op.send_splits = splits
        op.recv_splits = np.zeros(len(splits), dtype=np.int32)
        op.keep = [local, splits, op.recv_splits]
        MPI = _comm.mpi()
        first = op.state.aux.Ialltoall([splits, MPI.INT32_T], [op.recv_splits, MPI.INT32_T])
        return first, _alltoall_data(local)
    return start


def _alltoall_data(local: np.ndarray):
    def post(op):
        rb = op.row_bytes
        scounts = (op.send_splits.astype(np.int64) * rb).tolist()
        rcounts = (op.recv_splits.astype(np.int64) * rb).tolist()
        sdispls = np.concatenate([[0], np.cumsum(scounts)[:-1]]).astype(np.int64).tolist()
        rdispls = np.concatenate([[0], np.cumsum(rcounts)[:-1]]).astype(np.int64).tolist()
        recv = np.empty(int(sum(rcounts)), dtype=np.uint8)
        op.keep.append(recv)
        op.buffer = recv
        MPI = _comm.mpi()
        return op.state.data.Ialltoallv([local, (scounts, sdispls), MPI.BYTE],
                                        [recv, (rcounts, rdispls), MPI.BYTE])
    return post


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set, comm=None):
    state = state_of(process_set, comm)
    n = state.size
    first = tensor.shape[0] if tensor.dim() else 1
    if splits is None:
        if first % n:
            raise ValueError("splits not provided, but first dimension of tensor is not an even "
                             "multiple of the number of workers.")
        split_arr = np.full(n, first // n, dtype=np.int32)
    else:
        split_arr = np.asarray(splits.cpu() if torch.is_tensor(splits) else splits)
        if split_arr.ndim > 1:
            raise ValueError("alltoall expects a 1D splits tensor")
        if split_arr.size and not np.issubdtype(split_arr.dtype, np.integer):
            raise ValueError("alltoall expects splits to contain integer elements.")
        split_arr = split_arr.astype(np.int32)
        if len(split_arr) != n:
            raise ValueError("Number of entries in splits does not equal number of workers.")
        if (split_arr < 0).any():
            raise ValueError("alltoall splits must not be negative")
        if split_arr.sum() > first:
            raise ValueError("Sum of splits entries is greater than the first dimension of tensor.")
    local = np.array(E.raw_bytes(tensor), copy=True)

    def finish(o):
        flat = torch.from_numpy(o.buffer)
        values = flat.view(tensor.dtype) if flat.numel() else torch.empty(0, dtype=tensor.dtype)
        rows = int(o.recv_splits.sum())
        out = values.reshape([rows] + list(tensor.shape[1:])).to(tensor.device)
        return out, torch.from_numpy(o.recv_splits.copy())

    return _submit(state, ALLTOALL, name, tensor, _alltoall_start(local, split_arr), finish)


# -- reducescatter --------------------------------------------------------------------------

def scatter_rows(first_dim: int, n: int) -> List[int]:
    """Horovod's split: the first ``first_dim % n`` ranks get one row more."""
    return [first_dim // n + (1 if r < first_dim % n else 0) for r in range(n)]


def _reducescatter_start(local: Optional[np.ndarray]):
    def start(op, gathered):
        E.check_records(gathered, REDUCESCATTER)
        reduce_op, send = _reduction_send(gathered, REDUCESCATTER, local)
        ref = _ref(gathered)
        rows = scatter_rows(_rows(ref), op.state.size)
        counts = [r * _row_elems(ref) for r in rows]
        recv = np.empty(counts[op.state.rank], dtype=send.dtype)
        op.keep, op.buffer, op.my_rows = [send, recv], recv, rows[op.state.rank]
        return op.state.data.Ireduce_scatter(send, recv, counts, op=_mpi_op(reduce_op))
    return start


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0, comm=None):
    reduce_op = resolve_op(op, None)
    if reduce_op == Adasum:
        raise NotImplementedError("Adasum is not implemented by mpilearn")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor of at least one dimension")
    state = state_of(process_set, comm)
    local = _reduction_input(tensor, prescale_factor)

    def finish(o):
        value = _reduced(o.buffer, reduce_op, postscale_factor, state.size, tensor.dtype)
        return value.reshape([o.my_rows] + list(tensor.shape[1:])).to(tensor.device)

    return _submit(state, REDUCESCATTER, name, tensor, _reducescatter_start(local), finish,
                   op=reduce_op, prescale=prescale_factor, postscale=postscale_factor)


# -- join -----------------------------------------------------------------------------------

_ZERO_PARTICIPANT = {ALLREDUCE: _allreduce_start, REDUCESCATTER: _reducescatter_start}


def _join_start(op, gathered):
    active = E.active_rows(gathered)
    if len(active) == 0:
        last = int(np.max(gathered[:, 8]))
        latest = [i for i in range(len(gathered)) if gathered[i, 8] == last]
        op.last = op.state.ranks[max(latest)]
        return None
    kind = int(gathered[active[0], 0])
    if kind not in _ZERO_PARTICIPANT:  # the active ranks raise the same error and post nothing
        E.check_records(gathered, kind, first_dim_may_differ=kind in (ALLGATHER, ALLTOALL))
        raise E.HorovodInternalError(f"{E.KIND_NAMES.get(kind)} is not supported while some "
                                     "ranks have joined")
    return _ZERO_PARTICIPANT[kind](None)(op, gathered)


def join(device=-1, process_set=global_process_set, comm=None) -> int:
    """This rank has no more data: until every rank has joined, it takes part in the others'
    allreduce/reducescatter with zeros; their allgather/broadcast raise on every rank, as in
    Horovod. Returns the (global) rank that joined last."""
    state = state_of(process_set, comm)
    for pending in list(state.queue):  # this rank's own collectives come first
        E.progress(state, until=pending)
    joined_at = state.rounds
    while True:
        op_record = E.make_record(JOIN, None, None, join_round=joined_at)
        handle = E.submit(state, JOIN, None, op_record, _join_start, lambda o: getattr(o, "last", None))
        try:
            last = E.synchronize(handle)
        except E.HorovodInternalError:
            continue  # the others' collective failed; they see the error, we keep serving
        if last is not None:
            return last


def barrier(process_set=global_process_set, comm=None) -> None:
    E.barrier(state_of(process_set, comm))


def poll(handle) -> bool:
    if isinstance(handle, GroupHandle):
        return all(E.poll(h) for h in handle.handles)
    return E.poll(handle)


def synchronize(handle):
    if isinstance(handle, GroupHandle):
        results, error = [], None
        for h in handle.handles:
            try:
                results.append(E.synchronize(h))
            except E.HorovodInternalError as exc:
                error = error or exc
        if error is not None:
            raise error
        return results
    return E.synchronize(handle)


class GroupHandle:
    """The handle of a grouped collective: one result per tensor, in order."""

    def __init__(self, handles):
        self.handles = list(handles)
