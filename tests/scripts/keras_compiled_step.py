"""The Keras 3DGAN's compiled TensorFlow step (one tf.function for the four updates, the
allreduce inside) against the same steps run eagerly, on this communicator's ranks.

    mpirun -np N python keras_compiled_step.py VARIANT OUT.json
Every rank builds the same models (fixed seed) and trains 3 SGD steps on its own part of one
global batch, compiled and eagerly; rank 0 writes the largest relative weight difference, the
losses of both, and what a NaN batch does to the compiled step (it must stop, unapplied).
"""
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import keras  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "models"))
import gan3d_keras  # noqa: E402
from mpilearn.errors import TrainingStopped  # noqa: E402

variant, out = sys.argv[1], sys.argv[2]
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
hp = {"variant": variant, "preset": "small"} if variant == "angle" else {"variant": "fixed"}
shape = (51, 51, 25) if variant == "angle" else (25, 25, 25)
n_global = 8


def batch(step, poison=False):
    rng = np.random.default_rng(step)
    images = rng.gamma(0.5, 1e-3, (n_global, *shape)).astype("float32")
    if poison:
        images[:] = np.nan
    energy = rng.uniform(1.0, 2.0, n_global).astype("float32")
    part = slice(rank * n_global // size, (rank + 1) * n_global // size)
    b = {"images": images, "energy": energy, "ecal": images.sum(axis=(1, 2, 3)),
         "angle": rng.uniform(1.2, 1.9, n_global).astype("float32"), "_index": np.arange(n_global)}
    return {k: v[part] for k, v in b.items()}


def train(compiled):
    keras.utils.set_random_seed(3)
    task = gan3d_keras.build(hp)
    # plain SGD with a small lr, linear in the gradients: RMSprop's first steps are about
    # sign(g), so a rounding difference in a near-zero gradient would move a weight by a whole
    # lr, and the MAPE terms' large gradients make a larger SGD step diverge
    task.g_opt, task.d_opt = keras.optimizers.SGD(1e-7), keras.optimizers.SGD(1e-7)
    task.compiled = compiled
    task.setup(comm, "cpu", "mpi", 0)
    start = [np.asarray(w).copy() for m in task.models().values() for w in m.trainable_weights]
    losses = [task.train_step(batch(step)) for step in range(3)]
    moved = [np.asarray(w) - w0 for w0, w in
             zip(start, (w for m in task.models().values() for w in m.trainable_weights))]
    return task, losses, moved


fast, fast_losses, fast_moved = train(True)
slow, slow_losses, slow_moved = train(False)
# how differently the two moved the trainable weights, relative to how far they moved
rel = [max(float(np.max(np.abs(a - b))) for a, b in zip(fast_moved, slow_moved))
       / max(float(np.max(np.abs(b))) for b in slow_moved)]
before = [np.asarray(w).copy() for w in fast.discriminator.trainable_weights]
try:
    fast.train_step(batch(9, poison=True))
    stopped = None
except TrainingStopped as err:
    stopped = str(err)
unchanged = all(np.array_equal(a, np.asarray(w)) for a, w in zip(before, fast.discriminator.trainable_weights))
if rank == 0:
    with open(out, "w") as f:
        json.dump({"max_rel_diff": max(rel), "compiled_losses": fast_losses,
                   "eager_losses": slow_losses, "traced": fast._tf_updates is not None,
                   "nan_stopped": stopped, "d_unchanged_after_nan": unchanged}, f)
