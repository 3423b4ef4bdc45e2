"""Keras ``model.fit`` on mpilearn's Horovod API (``import mpilearn.tensorflow.keras as hvd``),
written for the tests: ``DistributedOptimizer``, ``BroadcastGlobalVariablesCallback``,
``MetricAverageCallback`` and ``LearningRateWarmupCallback``; rank 0 alone checkpoints.

    mpirun -np 2 python keras_fit.py --epochs 2 --warmup-epochs 1 --checkpoint-dir out

Every rank prints ``rank R epoch E loss L`` after the metrics are averaged, so the lines of
all ranks agree only if MetricAverageCallback did its work. Without ``--shard`` each rank
reads the whole set in its own shuffled order (the usual Horovod set-up); with it, rank r
reads rows r, r+size, ... in order, so that N ranks of batch B make the same steps as one
rank of batch N*B (the tests' equivalence check).
"""
import argparse
import os

import numpy as np
import tensorflow as tf

import mpilearn.tensorflow.keras as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--samples", type=int, default=256, help="the whole training set")
parser.add_argument("--batch-size", type=int, default=16, help="per rank")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--lr", type=float, default=0.001, help="for one rank; scaled by the ranks")
parser.add_argument("--warmup-epochs", type=int, default=0, help="0: no warm-up callback")
parser.add_argument("--shard", action="store_true")
parser.add_argument("--checkpoint-dir", default=None)
parser.add_argument("--save-weights", default=None, help="rank 0: final weights and losses (npz)")
args = parser.parse_args()

hvd.init()

# 3 classes told apart by the sign pattern of two of eight features
rng = np.random.default_rng(7)
features = rng.normal(size=(args.samples, 8)).astype("float32")
classes = (features[:, 0] > 0).astype("int64") + (features[:, 3] > 0.5).astype("int64")
if args.shard:
    features, classes = features[hvd.rank()::hvd.size()], classes[hvd.rank()::hvd.size()]
data = tf.data.Dataset.from_tensor_slices((features, classes)).repeat()
if not args.shard:
    data = data.shuffle(args.samples, seed=hvd.rank())
data = data.batch(args.batch_size)

tf.keras.utils.set_random_seed(11 + hvd.rank())  # the broadcast callback must align them
model = tf.keras.Sequential([tf.keras.Input((8,)),
                             tf.keras.layers.Dense(16, activation="relu"),
                             tf.keras.layers.Dense(3, activation="softmax")])
lr = args.lr * hvd.size()
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(lr)),
              loss="sparse_categorical_crossentropy", metrics=["accuracy"])


class Report(tf.keras.callbacks.Callback):
    """After MetricAverageCallback: what every rank sees as the epoch's metrics."""

    def on_epoch_end(self, epoch, logs=None):
        print(f"rank {hvd.rank()} epoch {epoch} loss {logs['loss']:.6f} "
              f"accuracy {logs['accuracy']:.6f}", flush=True)


callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank=0),
             hvd.callbacks.MetricAverageCallback()]
if args.warmup_epochs:
    callbacks.append(hvd.callbacks.LearningRateWarmupCallback(
        initial_lr=lr, warmup_epochs=args.warmup_epochs, verbose=1))
callbacks.append(Report())
if hvd.rank() == 0 and args.checkpoint_dir:
    callbacks.append(tf.keras.callbacks.ModelCheckpoint(
        os.path.join(args.checkpoint_dir, "epoch-{epoch}.keras")))

steps = args.samples // (args.batch_size * hvd.size())
history = model.fit(data, steps_per_epoch=steps, epochs=args.epochs, callbacks=callbacks,
                    verbose=0)
if hvd.rank() == 0 and args.save_weights:
    np.savez(args.save_weights, *[w.numpy() for w in model.weights],
             loss=np.array(history.history["loss"]))
