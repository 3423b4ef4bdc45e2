"""Throughput of a TensorFlow 2 custom loop on mpilearn's Horovod API, on random images:
``DistributedGradientTape`` (optionally sending the gradients as float16) and a first-batch
``broadcast_variables``. Written for the tests; its output line is what they check:

    mpirun -np 2 python tf_synthetic_benchmark.py --fp16-allreduce
    ...
    total: 123.4 +- 5.6 samples/s on 2 CPU ranks
"""
import argparse
import time

import numpy as np
import tensorflow as tf

import mpilearn.tensorflow as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--fp16-allreduce", action="store_true", help="gradients travel as float16")
parser.add_argument("--batch-size", type=int, default=8, help="per rank")
parser.add_argument("--image-size", type=int, default=64)
parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
parser.add_argument("--rounds", type=int, default=3, help="timed rounds")
parser.add_argument("--steps-per-round", type=int, default=4)
args = parser.parse_args()

hvd.init()
tf.keras.utils.set_random_seed(hvd.rank())
side = args.image_size
x = tf.random.uniform([args.batch_size, side, side, 3])
y = tf.random.uniform([args.batch_size], 0, 10, dtype=tf.int64)
net = tf.keras.Sequential([
    tf.keras.Input((side, side, 3)),
    tf.keras.layers.Conv2D(16, 3, strides=2, activation="relu"),
    tf.keras.layers.Conv2D(32, 3, strides=2, activation="relu"),
    tf.keras.layers.GlobalAveragePooling2D(),
    tf.keras.layers.Dense(10),
])
optimizer = tf.keras.optimizers.SGD(0.01)
wire = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none


@tf.function
def train_step(first):
    with tf.GradientTape() as tape:
        logits = net(x, training=True)
        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
            y, logits, from_logits=True))
    grads = hvd.DistributedGradientTape(tape, compression=wire).gradient(
        loss, net.trainable_variables)
    optimizer.apply_gradients(zip(grads, net.trainable_variables))
    if first:
        hvd.broadcast_variables(net.variables, root_rank=0)
        hvd.broadcast_variables(optimizer.variables, root_rank=0)


train_step(True)
for _ in range(args.warmup):
    train_step(False)
rates = []
for r in range(args.rounds):
    start = time.perf_counter()
    for _ in range(args.steps_per_round):
        train_step(False)
    rates.append(args.batch_size * args.steps_per_round / (time.perf_counter() - start))
    if hvd.rank() == 0:
        print(f"round {r}: {rates[-1]:.1f} samples/s per rank", flush=True)
if hvd.rank() == 0:
    mean, spread = np.mean(rates), 1.96 * np.std(rates)
    print(f"total: {hvd.size() * mean:.1f} +- {hvd.size() * spread:.1f} samples/s on "
          f"{hvd.size()} CPU ranks" + (" (fp16 gradients)" if args.fp16_allreduce else ""))
