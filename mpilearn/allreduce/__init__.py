"""Gradient averaging over fused flat buffers, with interchangeable transports.

A backend sums one contiguous tensor across the ranks of a communicator, asynchronously:
``handle = backend.allreduce_async(buf)`` then ``backend.wait(handle)``. Everything else
(fusion, averaging, overlap with backward) lives in :mod:`mpilearn.allreduce.fusion` and is
shared by all backends.
"""
from __future__ import annotations

from ..errors import UsageError

BACKENDS = ("mpi", "torch", "horovod")


def make_backend(name: str, comm, device: str = "cpu"):
    if name == "mpi":
        from .mpi import MPIBackend

        return MPIBackend(comm)
    if name == "torch":
        from .torch_dist import TorchDistBackend

        return TorchDistBackend(comm, device)
    if name == "horovod":
        from .horovod import HorovodBackend

        return HorovodBackend(comm)
    raise UsageError(f"unknown allreduce backend '{name}' (choose one of {', '.join(BACKENDS)})")


def available_backends() -> list:
    """Backends that can be constructed on this machine (horovod only when installed)."""
    names = ["mpi", "torch"]
    try:
        import horovod.torch  # noqa: F401

        names.append("horovod")
    except ImportError:
        pass
    return names
