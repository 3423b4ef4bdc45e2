"""A TensorFlow 2 custom training loop on mpilearn's Horovod API, written for the tests:
``DistributedGradientTape`` averages the gradients, and ``broadcast_variables`` inside the
compiled step gives every rank rank 0's weights and optimizer slots after the first batch.

    mpirun -np 2 python tf_custom_loop.py --steps 12 --checkpoint ckpt/run

Each rank starts from its own random weights on purpose: if the broadcast did not happen, the
ranks would end apart, and the last line ("replicas agree") would not be printed.
"""
import argparse

import numpy as np
import tensorflow as tf

import mpilearn.tensorflow as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20, help="global steps")
parser.add_argument("--batch-size", type=int, default=16, help="per rank")
parser.add_argument("--lr", type=float, default=0.01, help="for one rank; scaled by the ranks")
parser.add_argument("--checkpoint", default=None, help="rank 0 writes a tf.train.Checkpoint here")
args = parser.parse_args()

hvd.init()
tf.keras.utils.set_random_seed(100 + hvd.rank())  # different initial weights on each rank

# a 4-class problem on 12x12 single-channel images: the class is the quadrant that is bright
n = args.batch_size * args.steps
labels = np.random.default_rng(hvd.rank()).integers(0, 4, n)
images = np.random.default_rng(50 + hvd.rank()).normal(0.0, 0.2, (n, 12, 12, 1))
for i, c in enumerate(labels):
    row, col = divmod(int(c), 2)
    images[i, 6 * row:6 * row + 6, 6 * col:6 * col + 6] += 1.0
batches = tf.data.Dataset.from_tensor_slices((images.astype("float32"), labels))
batches = batches.batch(args.batch_size)

net = tf.keras.Sequential([
    tf.keras.Input((12, 12, 1)),
    tf.keras.layers.Conv2D(6, 3, activation="tanh"),
    tf.keras.layers.GlobalAveragePooling2D(),
    tf.keras.layers.Dense(4),
])
xent = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = tf.keras.optimizers.Adam(args.lr * hvd.size())


@tf.function
def step(x, y, first):
    with tf.GradientTape() as tape:
        loss = xent(y, net(x, training=True))
    tape = hvd.DistributedGradientTape(tape)  # .gradient() now returns the ranks' average
    grads = tape.gradient(loss, net.trainable_variables)
    optimizer.apply_gradients(zip(grads, net.trainable_variables))
    if first:  # after the first update, when the optimizer's slots exist
        hvd.broadcast_variables(net.variables, root_rank=0)
        hvd.broadcast_variables(optimizer.variables, root_rank=0)
    return loss


for i, (x, y) in enumerate(batches):
    loss = step(x, y, i == 0)
    if hvd.rank() == 0 and i % 4 == 0:
        print(f"step {i} loss {float(loss):.5f}", flush=True)

# every rank should hold the same weights: compare each with rank 0's copy
flat = np.concatenate([v.numpy().ravel() for v in net.variables])
root = hvd.broadcast(tf.constant(flat), root_rank=0).numpy()
apart = hvd.allreduce(tf.constant(float(np.abs(flat - root).max())), op=hvd.Max)
if hvd.rank() == 0:
    if args.checkpoint:
        tf.train.Checkpoint(model=net, optimizer=optimizer).write(args.checkpoint)
    if float(apart) == 0.0:
        print(f"replicas agree on {hvd.size()} ranks after {args.steps} steps")
    else:
        print(f"replicas differ by {float(apart)}")
