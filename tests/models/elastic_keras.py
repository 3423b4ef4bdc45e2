"""The Keras side of the elastic tests: a float64 Keras MLP with dropout (a random stream that
must come back right after a loss) that counts every event it trains on, in a non-trainable
variable summed over the live ranks (so it is in the weights and compared with them).
``MPILEARN_TEST_KILL`` and ``MPILEARN_TEST_STOP`` as in elastic_mlp.py."""
import os
import sys

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from elastic_mlp import arm  # noqa: E402

DEFAULTS = {"features": 8, "hidden": 16, "dropout": 0.2, "lr": 0.01, "events": 1024}


def build(hparams):
    from mpilearn.core import comm as mcomm
    from mpilearn.train.keras_tasks import as_task

    hp = {**DEFAULTS, **hparams}
    keras.config.set_floatx("float64")  # the elastic run and its replay compare bit for bit
    model = keras.Sequential([keras.Input((int(hp["features"]),)),
                              keras.layers.Dense(int(hp["hidden"]), activation="tanh"),
                              keras.layers.Dropout(float(hp["dropout"])),
                              keras.layers.Dense(1)])
    model.seen = keras.Variable(np.zeros(int(hp["events"])), trainable=False, name="seen")
    model.compile(optimizer=keras.optimizers.Adam(float(hp["lr"])), loss="mse")
    task = as_task(model)
    plain_step = task.train_step

    def train_step(batch):
        MPI = mcomm.mpi()
        losses = plain_step(batch)
        counts = np.zeros(int(hp["events"]))
        np.add.at(counts, np.asarray(batch["_index"]), 1.0)
        mcomm.context().comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)  # the live ranks
        model.seen.assign_add(counts)
        return losses

    task.train_step = train_step
    return arm(task)
