"""An elastic Keras script written against Horovod's API (hvd.elastic.run, KerasState and its
three callbacks, model.fit): with ``import horovod.tensorflow.keras as hvd`` it is a Horovod
elastic script. ``MPILEARN_TEST_KILL=R:B``: world rank R dies by SIGKILL at its batch B of the
first epoch. Rank 0 prints the final state as JSON: epochs done, size, reset sizes, and how
many batches each epoch ran after the last reset."""
import json
import os
import signal

import numpy as np
import tensorflow as tf

import mpilearn.tensorflow.keras as hvd

EPOCHS, BATCH, SAMPLES, LR = 3, 8, 96, 0.01

hvd.init()
rng = np.random.default_rng(0)
x = rng.normal(size=(SAMPLES, 4)).astype("float32")
y = x.sum(axis=1, keepdims=True)
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(LR * hvd.size())),
              loss="mse")
model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)  # builds the optimizer
victim = [int(v) for v in os.environ.get("MPILEARN_TEST_KILL", "-1:-1").split(":")]
world_rank = hvd.rank()
resets, batches = [], {}


class Victim(tf.keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if (world_rank, state.epoch, batch) == (victim[0], 0, victim[1]):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, batch, logs=None):
        batches[state.epoch] = batches.get(state.epoch, 0) + 1


state = hvd.elastic.KerasState(model, batch=0, epoch=0)


def on_state_reset():
    resets.append(hvd.size())
    model.optimizer.learning_rate.assign(LR * hvd.size())


state.register_reset_callbacks([on_state_reset])
callbacks = [Victim(), hvd.elastic.UpdateEpochStateCallback(state),
             hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.CommitStateCallback(state)]


@hvd.elastic.run
def train(state):
    batches.clear()
    state.model.fit(x, y, batch_size=BATCH, epochs=EPOCHS - state.epoch, callbacks=callbacks,
                    verbose=0, shuffle=False)


train(state)
weights = hvd.allgather_object([w.tolist() for w in model.get_weights()])
if hvd.rank() == 0:
    print(json.dumps({"epoch": state.epoch, "size": hvd.size(), "resets": resets,
                      "same_weights": all(w == weights[0] for w in weights),
                      "lr": float(model.optimizer.learning_rate.numpy())}), flush=True)
