"""How one collective runs: a metadata round, then the data collective, both non-blocking.

Every collective first gathers a small fixed record from each member (kind, name, dtype, op,
shape, root, scaling, device) on the set's ``meta`` communicator. With the records in hand,
every member takes the same decision: run the data collective on the ``data`` communicator,
or fail with the same error (mismatched shape, dtype, op, ...), so a mistake raises on every
rank instead of hanging or returning garbage. Operations are started in submission order, so
ranks must submit a set's collectives in the same order (Horovod instead matches them by
name; differing orders are reported as an error, never a hang).

Nothing blocks at submission: an ``*_async`` call posts its metadata round and returns a
handle, and progress is made by ``poll``/``synchronize`` (and by later submissions). A rank
that called :func:`join` keeps answering the other ranks' rounds with zeros until all joined.
"""
from __future__ import annotations

import hashlib
import itertools
from typing import Callable, Optional

import numpy as np
import torch

from ..core import comm as _comm
from . import timeline

# reduction ops, with Horovod's values
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
            Product: "Product"}

ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, JOIN = range(1, 7)
KIND_NAMES = {ALLREDUCE: "allreduce", ALLGATHER: "allgather", BROADCAST: "broadcast",
              ALLTOALL: "alltoall", REDUCESCATTER: "reducescatter", JOIN: "join"}

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.bool]
DTYPE_CODE = {d: i + 1 for i, d in enumerate(DTYPES)}
MAX_DIMS = 8
# record: kind, name hash, dtype, op, device, root, prescale, postscale, join round, numel,
# ndim, dims[MAX_DIMS], hash of further dims
META = 11 + MAX_DIMS + 1


class HorovodInternalError(RuntimeError):
    """A collective failed on every rank that took part (Horovod's exception type)."""


_HASHES = {}


def _name_hash(name: str) -> int:
    if name not in _HASHES:
        if len(_HASHES) > 100000:
            _HASHES.clear()
        _HASHES[name] = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(),
                                       "little", signed=True)
    return _HASHES[name]


def _float_bits(x: float) -> int:
    return int(np.array([x], dtype=np.float64).view(np.int64)[0])


def reduction_dtype(dtype: torch.dtype) -> torch.dtype:
    """What MPI sums: fp16/bf16 through float32, bool through int32 (so Sum cannot wrap)."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    if dtype == torch.bool:
        return torch.int32
    return dtype


def host_array(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU numpy view of ``t`` (a copy for CUDA tensors: staged through host)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().numpy()


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """Any dtype as bytes (bf16 has no numpy type), for collectives that do no arithmetic."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)


class Op:
    """One submitted collective; ``finish`` turns the received buffers into the result."""

    def __init__(self, state, kind: int, name: Optional[str], record: np.ndarray,
                 start: Callable, finish: Callable):
        self.state, self.kind, self.name = state, kind, name
        self.record = record
        self.gathered = np.zeros((state.size, META), dtype=np.int64)
        self.start, self.finish = start, finish
        self.request = None
        self.next = None           # a second stage to post once ``request`` completes
        self.phase = "meta"        # meta -> data -> done
        self.error: Optional[Exception] = None
        self.result = None
        self.keep = []             # buffers that must outlive the non-blocking calls


_handles = {}
_counter = itertools.count(1)


def make_record(kind: int, name: Optional[str], tensor: Optional[torch.Tensor], op: int = 0,
                root: int = -1, prescale: float = 1.0, postscale: float = 1.0,
                join_round: int = -1) -> np.ndarray:
    rec = np.zeros(META, dtype=np.int64)
    rec[0] = kind
    rec[1] = _name_hash(name) if name is not None else 0
    if tensor is not None:
        if tensor.dtype not in DTYPE_CODE:
            raise ValueError(f"Tensor type {tensor.type()} is not supported.")
        rec[2] = DTYPE_CODE[tensor.dtype]
        rec[4] = 1 if tensor.device.type == "cuda" else 0
        rec[9] = tensor.numel()
        rec[10] = tensor.dim()
        dims = list(tensor.shape)
        rec[11:11 + min(len(dims), MAX_DIMS)] = dims[:MAX_DIMS]
        if len(dims) > MAX_DIMS:
            rec[11 + MAX_DIMS] = _name_hash(",".join(map(str, dims[MAX_DIMS:])))
    rec[3], rec[5] = op, root
    rec[6], rec[7] = _float_bits(prescale), _float_bits(postscale)
    rec[8] = join_round
    return rec


def submit(state, kind: int, name: Optional[str], record: np.ndarray, start: Callable,
           finish: Callable) -> int:
    """Queue a collective and post its metadata round; returns a handle."""
    if name is not None:
        if name in state.pending_names:
            raise ValueError("Requested to allreduce, allgather, or broadcast a tensor with the "
                             "same name as another tensor that is currently being processed.  "
                             "If you want to request another tensor, use a different tensor "
                             f"name. (name: {name!r})")
    op = Op(state, kind, name, record, start, finish)
    op.row = f"{KIND_NAMES[kind]}.{name if name is not None else 'noname'}"
    timeline.record(op.row, "NEGOTIATE_" + KIND_NAMES[kind].upper(), "B", cycle=True)
    MPI = _comm.mpi()
    op.request = state.meta.Iallgather([record, MPI.INT64_T], [op.gathered, MPI.INT64_T])
    state.rounds += 1
    state.queue.append(op)
    if name is not None:
        state.pending_names[name] = op
    handle = next(_counter)
    _handles[handle] = op
    progress(state)
    return handle


def _ready(request, block: bool) -> bool:
    if request is None:
        return True
    if block:
        request.Wait()
        return True
    return bool(request.Test())


def _set_stage(op: Op, started) -> None:
    """``start`` returns a request, or (request, next) when a first exchange (alltoall's
    counts) must finish before the data collective can be posted by ``next(op)``."""
    op.request, op.next = started if isinstance(started, tuple) else (started, None)


def _post(op: Op, block: bool) -> bool:
    """Moves ``op`` until its data collective is posted; False if that has to wait."""
    if op.phase == "meta":
        if not _ready(op.request, block):
            return False
        op.phase = "data"
        timeline.record(op.row, "NEGOTIATE_" + KIND_NAMES[op.kind].upper(), "E")
        timeline.record(op.row, KIND_NAMES[op.kind].upper(), "B")
        try:
            _set_stage(op, op.start(op, op.gathered))
        except Exception as exc:  # the same decision on every member: nobody posts data
            _fail(op, exc)
            return True
    while op.phase == "data" and op.next is not None:
        if not _ready(op.request, block):
            return False
        nxt, op.next = op.next, None
        _set_stage(op, nxt(op))
    return True


def _finish(op: Op, block: bool) -> bool:
    if op.phase == "done":
        return True
    if not _post(op, block) or (op.phase != "done" and not _ready(op.request, block)):
        return False
    if op.phase != "done":
        try:
            op.result = op.finish(op)
        except Exception as exc:
            op.error = exc
        op.phase = "done"
        _release(op)
    return True


def _fail(op: Op, exc: Exception) -> None:
    op.error, op.phase, op.request, op.next = exc, "done", None, None
    _release(op)


def _release(op: Op) -> None:
    timeline.record(op.row, KIND_NAMES[op.kind].upper(), "E")
    state = op.state
    if op.name is not None and state.pending_names.get(op.name) is op:
        del state.pending_names[op.name]
    op.keep = []


def progress(state, until: Optional[Op] = None) -> None:
    """Start data collectives in submission order and finish what has arrived, without
    blocking; with ``until``, block until that operation is done."""
    for op in list(state.queue):
        if op is until:
            _finish(op, True)
            break
        if until is not None:
            _post(op, True)          # data collectives are posted in the shared order
            _finish(op, False)
        elif not _post(op, False):
            break                    # later data collectives must not overtake this one
        else:
            _finish(op, False)
    state.queue = [op for op in state.queue if op.phase != "done"]


def poll(handle: int) -> bool:
    op = _handles.get(handle)
    if op is None:
        raise ValueError(f"unknown or already synchronized handle {handle!r}")
    if op.phase != "done":
        progress(op.state)
    return op.phase == "done"


def synchronize(handle: int):
    """Wait for a handle and return its result (raises HorovodInternalError on failure)."""
    op = _handles.get(handle)
    if op is None:
        return None
    if op.phase != "done":
        progress(op.state, until=op)
    del _handles[handle]
    if op.error is not None:
        if isinstance(op.error, HorovodInternalError):
            raise op.error
        raise HorovodInternalError(str(op.error)) from op.error
    return op.result


# -- checks on the gathered records ---------------------------------------------------------

def _shape(row) -> list:
    return [int(x) for x in row[11:11 + min(int(row[10]), MAX_DIMS)]] + (
        ["..."] if row[10] > MAX_DIMS else [])


def active_rows(gathered: np.ndarray) -> np.ndarray:
    """Indices of members taking part (not joined)."""
    return np.nonzero(gathered[:, 0] != JOIN)[0]


def check_records(gathered: np.ndarray, kind: int, first_dim_may_differ: bool = False) -> None:
    """Raise the error every member will raise when the members' records disagree."""
    rows = active_rows(gathered)
    ref = gathered[rows[0]]
    active = gathered[rows]
    # the usual case in one comparison: every record equal (but the first dimension)
    same = active == ref
    if first_dim_may_differ:
        same[:, 9] = same[:, 11] = True
    if same.all():
        return
    what = KIND_NAMES[kind]
    for i in rows:
        row = gathered[i]
        if row[0] != kind:
            raise HorovodInternalError(
                f"Mismatched operations: rank {rows[0]} did an {KIND_NAMES.get(int(ref[0]), '?')}, "
                f"rank {i} did an {KIND_NAMES.get(int(row[0]), '?')}: every rank must submit the "
                "same collectives in the same order")
        if row[1] != ref[1]:
            raise HorovodInternalError(
                f"Mismatched {what} names: ranks {rows[0]} and {i} submitted differently named "
                "tensors at the same position; submit collectives in the same order on every rank")
        if row[2] != ref[2]:
            raise HorovodInternalError(
                f"Mismatched data types: One rank had type {DTYPES[ref[2] - 1]}, but another rank "
                f"had type {DTYPES[row[2] - 1]}.")
        if row[4] != ref[4]:
            raise HorovodInternalError(
                f"Mismatched {what} CPU/GPU device selection: One rank specified device "
                f"{'GPU' if ref[4] else 'CPU'}, but another rank specified device "
                f"{'GPU' if row[4] else 'CPU'}.")
        if row[3] != ref[3]:
            raise HorovodInternalError(
                f"Mismatched reduction operation: One rank had reduce op "
                f"{OP_NAMES.get(int(ref[3]))}, but another rank had reduce op "
                f"{OP_NAMES.get(int(row[3]))}.")
        if row[5] != ref[5]:
            raise HorovodInternalError(
                f"Mismatched {what} root ranks: One rank specified root rank {ref[5]}, but "
                f"another rank specified root rank {row[5]}.")
        if row[6] != ref[6] or row[7] != ref[7]:
            raise HorovodInternalError("Mismatched prescale and/or postscale factors")
        same = (row[10] == ref[10] and row[11 + MAX_DIMS] == ref[11 + MAX_DIMS] and
                (np.array_equal(row[12:11 + MAX_DIMS], ref[12:11 + MAX_DIMS]) if first_dim_may_differ
                 else np.array_equal(row[9:11 + MAX_DIMS], ref[9:11 + MAX_DIMS])))
        if not same:
            detail = "rank or non-first dimension" if first_dim_may_differ else "shape"
            raise HorovodInternalError(
                f"Mismatched {what} tensor {detail}s: One rank sent a tensor of shape "
                f"{_shape(ref)}, but another rank sent a tensor of shape {_shape(row)}.")


def barrier(state) -> None:
    """Every member reaches this point (pending collectives are not waited for)."""
    state.sync.Barrier()
