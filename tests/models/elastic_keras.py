"""The Keras side of the elastic tests (TensorFlow backend): a float64 Keras MLP with dropout (a
random stream that must come back right after a loss) that counts every event it trains on, in
a non-trainable variable summed over the live ranks (so it is in the weights and compared with
them). Its step is one ``tf.function``, as the compiled Keras 3DGAN's four updates are: a rank
lost mid-step is then seen inside a TensorFlow graph, which turns MPI's error into its own, and
the trace, which holds the communicator, is traced again after the shrink.
``MPILEARN_TEST_KILL`` and ``MPILEARN_TEST_STOP`` as in elastic_mlp.py."""
import os
import sys

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from elastic_mlp import arm  # noqa: E402

from mpilearn.train.keras_tasks import KerasSupervisedTask  # noqa: E402

# count: 0 leaves out the counter's allreduce over the job (a sweep's folds are not the job)
DEFAULTS = {"features": 8, "hidden": 16, "dropout": 0.2, "lr": 0.01, "events": 1024, "count": 1}


class CompiledStep(KerasSupervisedTask):
    _traced = None

    def train_step(self, batch):
        import tensorflow as tf

        if self._traced is None:
            self._traced = tf.function(lambda x, y: self._step(
                self.model, self.optimizer, lambda: self.loss(y, self.model(x, training=True))),
                autograph=False, reduce_retracing=True)
        y = np.asarray(batch[self.target], dtype="float64")[:, None]
        return {"loss": float(self._traced(self._xs(batch), y))}

    def rebind(self, comm) -> None:
        super().rebind(comm)
        self._traced = None


def build(hparams):
    from mpilearn.core import comm as mcomm

    hp = {**DEFAULTS, **hparams}
    keras.config.set_floatx("float64")  # the elastic run and its replay compare bit for bit
    model = keras.Sequential([keras.Input((int(hp["features"]),)),
                              keras.layers.Dense(int(hp["hidden"]), activation="tanh"),
                              keras.layers.Dropout(float(hp["dropout"])),
                              keras.layers.Dense(1)])
    model.seen = keras.Variable(np.zeros(int(hp["events"])), trainable=False, name="seen")
    model.compile(optimizer=keras.optimizers.Adam(float(hp["lr"])), loss="mse")
    task = CompiledStep(model, "mse", model.optimizer)
    if not int(hp["count"]):
        return arm(task)
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
