"""The Keras MLP example, but rank 1's inputs turn NaN at its third training step."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "models"))
import keras_mlp  # noqa: E402

import mpilearn  # noqa: E402
from mpilearn.train.keras_tasks import as_task  # noqa: E402

DEFAULTS = keras_mlp.DEFAULTS


def build(hparams):
    task = as_task(keras_mlp.build(hparams))
    plain_step = task.train_step
    calls = {"n": 0}

    def train_step(batch):
        calls["n"] += 1
        if mpilearn.rank() == 1 and calls["n"] == 3:
            batch = {**batch, "X": np.full_like(batch["X"], np.nan)}
        return plain_step(batch)

    task.train_step = train_step
    return task
