"""Horovod's TF2 Keras MNIST example (tensorflow2_keras_mnist.py) ported by changing the import
line, plus the two edits Keras 3 itself forces: ``experimental_run_tf_function`` is gone from
``compile()`` and checkpoints end in ``.keras``. The data are synthetic and, for the
equivalence test, each rank reads a disjoint shard in order (``--shard``) instead of its own
shuffled copy; ``--no-warmup`` makes the learning rate independent of the number of ranks."""
import argparse
import os

import numpy as np
import tensorflow as tf

import mpilearn.tensorflow.keras as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--lr", type=float, default=0.001)
parser.add_argument("--shard", action="store_true")
parser.add_argument("--no-warmup", action="store_true")
parser.add_argument("--checkpoint-dir", default=None)
parser.add_argument("--save-weights", default=None)
args = parser.parse_args()

# Horovod: initialize Horovod.
hvd.init()

# Horovod: pin GPU to be used to process local rank (one GPU per process)
gpus = tf.config.experimental.list_physical_devices("GPU")
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

rng = np.random.default_rng(0)
n = args.batch_size * args.steps * max(hvd.size(), 2)
mnist_labels = rng.integers(0, 10, n)
mnist_images = rng.normal(0, 0.3, (n, 28, 28)).astype("float32")
for i, t in enumerate(mnist_labels):
    mnist_images[i, 2 * t:2 * t + 6, 4:24] += 1.0
if args.shard:
    mnist_images, mnist_labels = mnist_images[hvd.rank()::hvd.size()], mnist_labels[hvd.rank()::hvd.size()]

dataset = tf.data.Dataset.from_tensor_slices(
    (tf.cast(mnist_images[..., tf.newaxis], tf.float32), tf.cast(mnist_labels, tf.int64)))
dataset = dataset.repeat() if args.shard else dataset.repeat().shuffle(10000)
dataset = dataset.batch(args.batch_size)

tf.keras.utils.set_random_seed(1)
mnist_model = tf.keras.Sequential([
    tf.keras.Input((28, 28, 1)),
    tf.keras.layers.Conv2D(8, [3, 3], activation="relu"),
    tf.keras.layers.Conv2D(16, [3, 3], activation="relu"),
    tf.keras.layers.MaxPooling2D(pool_size=(4, 4)),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(32, activation="relu"),
    tf.keras.layers.Dense(10, activation="softmax"),
])

# Horovod: adjust learning rate based on number of GPUs.
scaled_lr = args.lr * hvd.size()
opt = tf.optimizers.Adam(scaled_lr)

# Horovod: add Horovod DistributedOptimizer.
opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1, average_aggregated_gradients=True)

# Horovod: Specify `experimental_run_tf_function=False` to ensure TensorFlow
# uses hvd.DistributedOptimizer() to compute gradients.  [Keras 3: the argument is gone]
mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt,
                    metrics=["accuracy"])

callbacks = [
    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    # Horovod: average metrics among workers at the end of every epoch.
    hvd.callbacks.MetricAverageCallback(),
]
if not args.no_warmup:
    # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final
    # accuracy. Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
    # the first three epochs.
    callbacks.append(hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr,
                                                              warmup_epochs=1, verbose=1))

# Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
if hvd.rank() == 0 and args.checkpoint_dir:
    callbacks.append(tf.keras.callbacks.ModelCheckpoint(
        os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")))  # [Keras 3: .keras]

# Horovod: write logs on worker 0.
verbose = 1 if hvd.rank() == 0 else 0

# Train the model.
# Horovod: adjust number of steps based on number of GPUs.
history = mnist_model.fit(dataset, steps_per_epoch=args.steps * 2 // hvd.size(),
                          callbacks=callbacks, epochs=args.epochs, verbose=verbose)
if hvd.rank() == 0 and args.save_weights:
    np.savez(args.save_weights, *[w.numpy() for w in mnist_model.weights],
             loss=np.array(history.history["loss"]))
