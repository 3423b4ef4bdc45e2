"""Horovod transport: delegates the fused buffers to ``horovod.torch`` when installed."""
from __future__ import annotations

import itertools

from ..errors import UsageError


class HorovodBackend:
    name = "horovod"

    def __init__(self, comm):
        try:
            import horovod.torch as hvd
        except ImportError as err:
            raise UsageError(
                "train.backend is 'horovod' but horovod.torch cannot be imported "
                f"({err}); build it with 'make horovod' or choose backend mpi") from None
        if not hvd.is_initialized():
            hvd.init(comm=comm)
        if hvd.size() != comm.Get_size():
            raise UsageError("horovod was initialised on another communicator than this run's")
        self.hvd = hvd
        self._names = itertools.count()

    def allreduce_async(self, buf):
        handle = self.hvd.allreduce_async_(buf, op=self.hvd.Sum, name=f"mpilearn.{next(self._names)}")
        return handle, buf

    def wait(self, handle) -> None:
        self.hvd.synchronize(handle[0])

