"""LearningRateWarmupCallback under model.fit(), with Horovod's convention (initial_lr is the
scaled rate): prints the lr seen at each batch (rank 0)."""
import json
import sys

import keras
import numpy as np

import mpilearn.keras as hvd

hvd.init()
seen = []


class Record(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        seen.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse",
              jit_compile=False)
x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0,
          callbacks=[hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.01 * hvd.size(),
                                                               warmup_epochs=1, steps_per_epoch=4),
                     Record()])
if hvd.rank() == 0:
    print(json.dumps(seen))
