"""The Keras MLP example with a pause per step, so a test can kill it mid-epoch."""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "models"))
import keras_mlp  # noqa: E402

from mpilearn.train.keras_tasks import as_task  # noqa: E402

DEFAULTS = {**keras_mlp.DEFAULTS, "sleep": 0.04}


def build(hparams):
    task = as_task(keras_mlp.build({k: v for k, v in hparams.items() if k != "sleep"}))
    plain_step = task.train_step

    def train_step(batch):
        time.sleep(hparams.get("sleep", DEFAULTS["sleep"]))
        return plain_step(batch)

    task.train_step = train_step
    return task
