"""Alias of :mod:`mpilearn.keras.callbacks` (``hvd.callbacks`` under Horovod's module path)."""
from ...keras.callbacks import *  # noqa: F401,F403
