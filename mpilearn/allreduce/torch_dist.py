"""torch.distributed transport: gloo on CPU, NCCL on GPU.

The rendezvous goes through MPI (rank 0 opens a TCPStore on a free port and broadcasts the
address), so no extra launcher or MASTER_ADDR is needed, and each communicator gets its own
process group: HPO blocks do not share the default group.
"""
from __future__ import annotations

import atexit
import collections
import datetime
import os
import socket
import time

import torch
import torch.distributed as dist

_TIMEOUT = datetime.timedelta(minutes=30)


def _address() -> str:
    host = socket.gethostname()
    try:
        return socket.gethostbyname(host)
    except OSError:
        return "127.0.0.1"


def _gpu_identity(device: str) -> str:
    """A name for this rank's physical GPU: its UUID where torch exposes it."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        return str(uuid)
    return f"{socket.gethostname()}:{os.environ.get('CUDA_VISIBLE_DEVICES', '')}:{index}"


def _refuse_shared_gpu(comm, device: str) -> None:
    """NCCL cannot put two ranks on one GPU (it fails, or hangs, at the first collective):
    say so at set-up, on every rank, naming the ranks."""
    from ..errors import UsageError

    ids = comm.allgather(_gpu_identity(device))
    mine = [r for r, g in enumerate(ids) if g == ids[comm.Get_rank()]]
    if len(mine) > 1:
        raise UsageError(f"backend 'torch' (NCCL) cannot share a GPU between ranks, but ranks "
                         f"{', '.join(map(str, mine))} all use {device} ({ids[mine[0]]}): run "
                         "one rank per GPU, or use the 'mpi' backend to share GPUs")


class TorchDistBackend:
    name = "torch"

    def __init__(self, comm, device: str = "cpu"):
        rank, size = comm.Get_rank(), comm.Get_size()
        store = None
        if rank == 0:
            store = dist.TCPStore(_address(), 0, size, True, timeout=_TIMEOUT,
                                  wait_for_workers=False)
            where = (_address(), store.port)
        else:
            where = None
        host, port = comm.bcast(where, root=0)
        if store is None:
            store = dist.TCPStore(host, port, size, False, timeout=_TIMEOUT)
        self._store = store
        if device.startswith("cuda"):
            _refuse_shared_gpu(comm, device)
            self.pg = dist.ProcessGroupNCCL(store, rank, size)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, size, _TIMEOUT)
        # A gloo worker thread that drops the last reference to a Python-owned tensor while
        # the interpreter finalises aborts the process ("terminate called ...", signal 6).
        # So the most recent buffers stay referenced here until an exit hook, run while
        # Python is still whole, lets the threads finish, shuts the group down and drops them.
        self._recent = collections.deque(maxlen=256)
        atexit.register(self.close)

    def close(self) -> None:
        time.sleep(0.05)
        try:
            self.pg.shutdown()
        except Exception:  # already shut down, or an older torch without shutdown()
            pass
        self._recent.clear()

    def allreduce_async(self, buf: torch.Tensor):
        work = buf if buf.dtype in (torch.float32, torch.float64) or buf.is_cuda else buf.float()
        handle = (self.pg.allreduce([work]), buf, work)
        self._recent.append(handle)
        return handle

    def wait(self, handle) -> None:
        job, buf, work = handle
        job.wait()
        if work is not buf:
            buf.copy_(work)

