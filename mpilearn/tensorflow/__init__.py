"""Horovod's import path: ``import mpilearn.tensorflow.keras as hvd`` is ``mpilearn.keras``."""
