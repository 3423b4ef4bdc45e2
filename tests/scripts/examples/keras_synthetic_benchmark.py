"""Throughput of Keras ``model.fit`` on mpilearn's Horovod API, on random images:
``DistributedOptimizer`` (optionally float16 on the wire) with the broadcast and
metric-averaging callbacks. Written for the tests; its output line is what they check:

    mpirun -np 2 python keras_synthetic_benchmark.py
    ...
    total: 123.4 +- 5.6 samples/s on 2 CPU ranks
"""
import argparse
import time

import numpy as np
import tensorflow as tf

import mpilearn.tensorflow.keras as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--fp16-allreduce", action="store_true", help="gradients travel as float16")
parser.add_argument("--batch-size", type=int, default=8, help="per rank")
parser.add_argument("--image-size", type=int, default=64)
parser.add_argument("--rounds", type=int, default=3, help="timed epochs, after one untimed")
parser.add_argument("--steps-per-round", type=int, default=4)
args = parser.parse_args()

hvd.init()
side = args.image_size
images = np.random.default_rng(hvd.rank()).uniform(size=(args.batch_size, side, side, 3))
labels = np.random.default_rng(hvd.rank()).integers(0, 10, args.batch_size)
data = tf.data.Dataset.from_tensor_slices((images.astype("float32"), labels))
data = data.cache().repeat().batch(args.batch_size)
net = tf.keras.Sequential([
    tf.keras.Input((side, side, 3)),
    tf.keras.layers.Conv2D(16, 3, strides=2, activation="relu"),
    tf.keras.layers.Conv2D(32, 3, strides=2, activation="relu"),
    tf.keras.layers.GlobalAveragePooling2D(),
    tf.keras.layers.Dense(10, activation="softmax"),
])
wire = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
net.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01), compression=wire),
            loss="sparse_categorical_crossentropy")


class Clock(tf.keras.callbacks.Callback):
    """Samples per second of each epoch but the first (tracing and the broadcast)."""

    rates = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        rate = args.batch_size * args.steps_per_round / (time.perf_counter() - self.start)
        if epoch > 0:
            self.rates.append(rate)
            print(f"round {epoch - 1}: {rate:.1f} samples/s per rank", flush=True)


callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
             hvd.callbacks.MetricAverageCallback()]
clock = Clock()
if hvd.rank() == 0:
    callbacks.append(clock)
net.fit(data, steps_per_epoch=args.steps_per_round, epochs=args.rounds + 1,
        callbacks=callbacks, verbose=0)
if hvd.rank() == 0:
    mean, spread = np.mean(clock.rates), 1.96 * np.std(clock.rates)
    print(f"total: {hvd.size() * mean:.1f} +- {hvd.size() * spread:.1f} samples/s on "
          f"{hvd.size()} CPU ranks" + (" (fp16 gradients)" if args.fp16_allreduce else ""))
