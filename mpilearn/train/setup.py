"""The driver's set-up steps that need no driver: seeding and determinism, the data files
counted once by rank 0 and shared, and the split of events into training and validation."""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch

from ..core.comm import check_on_root
from ..data.hdf5 import EventFiles, split_events
from .checks import open_files


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


def shared_files(config: dict, task, comm) -> tuple:
    """(train, validation, test) EventFiles (None where not given): rank 0 opens and counts
    them (bad input is reported there, once), every rank gets the counts."""
    files = check_on_root(comm, open_files, config, task)
    meta = comm.bcast(None if files is None else
                      [(f.paths, f.counts, sorted(f.optional_present)) if f else None
                       for f in files], root=0)
    out = tuple(EventFiles.from_counts(*m, keys=task.keys) if m else None for m in meta)
    for files in out:
        if files is not None:
            files.on_error = config["data"]["on_error"]
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
