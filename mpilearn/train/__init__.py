"""Training: tasks (what a model builder returns) and the data-parallel engine."""

__all__ = ["SupervisedTask", "Task"]


def __getattr__(name):
    # on first use: ``python -m mpilearn.train --help`` must not pay for importing torch
    if name in __all__:
        from . import tasks

        return getattr(tasks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
