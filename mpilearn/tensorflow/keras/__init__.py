"""Alias of :mod:`mpilearn.keras` under Horovod's module path
(``import horovod.tensorflow.keras as hvd`` -> ``import mpilearn.tensorflow.keras as hvd``)."""
from ...keras import *  # noqa: F401,F403
from ...keras import __all__  # noqa: F401
from . import callbacks  # noqa: F401
