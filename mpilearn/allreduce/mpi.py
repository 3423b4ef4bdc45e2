"""mpi4py transport: non-blocking MPI_Iallreduce directly on the tensor's memory.

CPU tensors are handed to MPI as numpy views (no copy). CUDA tensors go to MPI directly
when the library is CUDA-aware, otherwise they are staged through host memory.
"""
from __future__ import annotations

import torch

from ..comm import mpi

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

    def __init__(self, comm):
        self.comm = comm
        self._cuda_aware = None

    def allreduce_async(self, buf: torch.Tensor):
        MPI = mpi()
        work = buf
        if buf.is_cuda:
            if self._cuda_aware is None:
                self._cuda_aware = cuda_aware()
            if not self._cuda_aware:
                work = buf.to("cpu", torch.float32)
                torch.cuda.current_stream().synchronize()
            else:
                torch.cuda.current_stream().synchronize()
        if buf.dtype not in _NATIVE:
            work = work.to(torch.float32)
        target = work.numpy() if not work.is_cuda else work
        request = self.comm.Iallreduce(MPI.IN_PLACE, target, op=MPI.SUM)
        return request, buf, work

    def wait(self, handle) -> None:
        request, buf, work = handle
        request.Wait()
        if work is not buf:
            buf.copy_(work)

    def progress(self, handles) -> None:
        """Let MPI advance outstanding requests (Open MPI progresses inside MPI calls)."""
        if handles:
            mpi().Request.Testall([h[0] for h in handles])
