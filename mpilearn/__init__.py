"""mpilearn: MPI data-parallel training and hyperparameter search for HPC.

``import mpilearn.torch as hvd`` gives the Horovod-shaped API; ``python -m mpilearn.train``
runs a training job. MPI is initialised by ``init()``, never on import.
"""
__version__ = "0.2.0"  # = pyproject.toml's version (tests/test_layout.py)


def init(comm=None):
    from .core.comm import init as _init

    return _init(comm)


def rank() -> int:
    from .core.comm import context

    return context().rank


def size() -> int:
    from .core.comm import context

    return context().size


def local_rank() -> int:
    from .core.comm import context

    return context().local_rank


def local_size() -> int:
    from .core.comm import context

    return context().local_size
