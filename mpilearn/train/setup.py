"""The driver's construction steps that need no driver: seeding and determinism, the task
built from the model file, the data files from the counts rank 0 planned, and the split of
events into training and validation. Nothing here checks (``plan.py`` did)."""
from __future__ import annotations

import os
import sys
from typing import Optional

import numpy as np
import torch

from ..core.builders import load_builder
from ..data.hdf5 import EventFiles, split_events
from .checks import build_task


def seed_and_determinism(train: dict) -> None:
    """The run's seeds, and ``train.deterministic``'s library switches."""
    torch.manual_seed(train["seed"])
    np.random.seed(train["seed"])
    if train["deterministic"]:
        # cuBLAS is deterministic only with a fixed workspace, set before its first handle
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # warn_only: on CUDA some ops have no deterministic kernel (the 3DGAN's 3-D average
        # pooling backward raised on an H100); they warn instead of ending the run
        torch.use_deterministic_algorithms(True, warn_only=True)
    # cuDNN picks the fastest convolution per input shape (the 3DGAN's shapes are fixed)
    torch.backends.cudnn.benchmark = not train["deterministic"]


def new_task(config: dict):
    """The run's seeds, then the model file's task; its attributes from ``train``."""
    train = config["train"]
    seed_and_determinism(train)
    builder = load_builder(config["model"])
    if "keras" in sys.modules:  # the model file uses Keras: its initialisers too
        seed_keras(train["seed"])
    task = build_task(builder, config["model"], config["hparams"])
    task.precision = train["precision"]
    task.compile_mode, task.channels_last = train["compile"], train["channels_last"]
    noise = train.get("noise_scale", {})  # a partial config (a replay's) measures nothing
    task.noise_scale = noise.get("enabled", False) and train.get("algorithm") == "allreduce"
    task.halves_every = noise.get("halves_every", 0)
    return task


def seed_keras(seed: int) -> None:
    """``keras.utils.set_random_seed``, without importing TensorFlow on another backend.

    Keras's own function also seeds TensorFlow whenever it is installed, for ``tf.data``
    pipelines; mpilearn reads no ``tf.data``, and the import costs a torch-backend rank
    3.7 CPU-s and TensorFlow's thread pools (Keras's export still imports it, on rank 0 at
    the end). So on another backend, and while the model file has not imported TensorFlow
    itself, the same steps are done here but that one."""
    import keras

    if keras.config.backend() == "tensorflow" or "tensorflow" in sys.modules:
        keras.utils.set_random_seed(seed)
        return
    import random

    try:  # the steps of keras/src/utils/rng_utils.py (Keras 3)
        from keras.src.backend.common import global_state
        from keras.src.random import seed_generator
        from keras.src.utils import rng_utils
    except ImportError:  # another Keras layout: its own function, TensorFlow and all
        keras.utils.set_random_seed(seed)
        return
    global_state.set_global_attribute(rng_utils.GLOBAL_RANDOM_SEED, seed)
    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, None)
    random.seed(seed)
    np.random.seed(seed)
    if keras.config.backend() == "torch":
        torch.manual_seed(seed)


def counted(files) -> list:
    """What rank 0 learned of each (train, validation, test) EventFiles: enough for
    :func:`shared_files` on every rank."""
    return [(f.paths, f.counts, sorted(f.optional_present)) if f else None for f in files]


def shared_files(counts: list, task, on_error: str) -> tuple:
    """(train, validation, test) EventFiles (None where not given) from rank 0's counts,
    without touching the files."""
    out = tuple(EventFiles.from_counts(*m, keys=task.keys) if m else None for m in counts)
    for files in out:
        if files is not None:
            files.on_error = on_error
    return out


def event_split(config: dict, train_files, val_files, events: Optional[tuple] = None) -> tuple:
    """(training, validation) event indices: given (an HPO fold's), a seeded fraction of the
    training files, or all of them with the validation files' own events."""
    if events is not None:
        return tuple(np.asarray(e) for e in events)
    n = len(train_files)
    if val_files is None and config["data"]["val_fraction"] > 0:
        return split_events(n, config["data"]["val_fraction"], config["train"]["seed"])
    return np.arange(n), (np.arange(len(val_files)) if val_files else np.arange(0))
