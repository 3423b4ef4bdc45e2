"""mpi4py transport: MPI_Allreduce directly on the tensor's memory.

CPU tensors are handed to MPI as numpy views (no copy). CUDA tensors go to MPI directly
when the library is CUDA-aware, otherwise they are staged through host memory.

By default a bucket's reduction is a *blocking* MPI_Allreduce issued when the optimizer
synchronises: measured here (Open MPI 5, np=2, 5.4 MB), MPI_Iallreduce + Wait took 1.7 ms
against 0.64 ms for MPI_Allreduce on a quiet machine (13.9 against 1.1 ms on a loaded one),
because Open MPI's non-blocking collectives use a slower algorithm and make no progress
outside MPI calls, so they bought no overlap. With an MPI
that progresses asynchronously, ``MPILEARN_MPI_NONBLOCKING=1`` starts each bucket with
MPI_Iallreduce from the gradient hook instead.
"""
from __future__ import annotations

import os

import torch

from ..core.comm import mpi

# dtypes MPI can sum natively; others (bf16, fp16) are summed in float32
_NATIVE = (torch.float32, torch.float64)


def cuda_aware() -> bool:
    MPI = mpi()
    query = getattr(MPI, "Query_cuda_support", None)
    try:
        return bool(query()) if query else False
    except Exception:  # an MPI without the MPIX extension
        return False


class MPIBackend:
    name = "mpi"

    def __init__(self, comm, nonblocking=None):
        self.comm = comm
        self._cuda_aware = None
        if nonblocking is None:
            nonblocking = os.environ.get("MPILEARN_MPI_NONBLOCKING", "0") == "1"
        self.nonblocking = nonblocking

    def allreduce_async(self, buf: torch.Tensor):
        MPI = mpi()
        work = buf
        if buf.is_cuda:
            if self._cuda_aware is None:
                self._cuda_aware = cuda_aware()
            if not self._cuda_aware:  # staged in the dtype MPI sums: float64 stays float64
                work = buf.to("cpu", buf.dtype if buf.dtype in _NATIVE else torch.float32)
                torch.cuda.current_stream().synchronize()
            else:
                torch.cuda.current_stream().synchronize()
        if buf.dtype not in _NATIVE:
            work = work.to(torch.float32)
        target = work.numpy() if not work.is_cuda else work
        request = self.comm.Iallreduce(MPI.IN_PLACE, target, op=MPI.SUM) if self.nonblocking else None
        return request, buf, work, target

    def wait(self, handle) -> None:
        request, buf, work, target = handle
        if request is None:
            MPI = mpi()
            self.comm.Allreduce(MPI.IN_PLACE, target, op=MPI.SUM)
        else:
            request.Wait()
        if work is not buf:
            buf.copy_(work)
