"""The Keras 3DGAN's four DistributedGradientTapes against the fused path (the wrapped
optimizers reduce inside apply()), in float64, on 2 ranks, in one process per rank:

    mpirun -np 2 python keras_gan_tapes.py OUT.json

- np=2: tapes vs fused, each rank its half of every global batch;
- np=1 (COMM_SELF, the whole batch): tapes vs fused, and np=1 vs np=2;
- on a block communicator of the world with the ranks in reverse order (the trainer hands
  an HPO block's sub-communicator to the task the same way), with a rank that has zero
  events in a step (block rank 0 in step 1, block rank 1 in step 2): the same weights as
  one rank that had all of them.
Rank 0 writes each comparison's largest weight difference relative to how far the weights
moved.
"""
import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import keras  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "models"))
import gan3d_keras  # noqa: E402

keras.config.set_floatx("float64")


class MeanPool3D(keras.layers.Layer):
    """AveragePooling3D(2) (VALID) as strided slices and a mean: TensorFlow has no float64
    CPU kernel for AvgPool3D. The same arithmetic, per event, so it changes no comparison."""

    def __init__(self, pool_size=2, **kwargs):
        super().__init__(**kwargs)

    def call(self, x):
        for axis in (1, 2, 3):  # pairs along each spatial axis; an odd last cell is dropped
            n = x.shape[axis] // 2
            even = [slice(None)] * 5
            odd = [slice(None)] * 5
            even[axis], odd[axis] = slice(0, 2 * n, 2), slice(1, 2 * n, 2)
            x = (x[tuple(even)] + x[tuple(odd)]) * 0.5
        return x


gan3d_keras.layers.AveragePooling3D = MeanPool3D
# no dropout and no batch norm: both depend on how the batch is split over the ranks
HPARAMS = {"variant": "angle", "preset": "small", "dropout": 0.0, "batch_norm": False}
out = sys.argv[1]
world = MPI.COMM_WORLD
n_global, steps = 6, 3


def batch(step, lo, hi):
    rng = np.random.default_rng(step)
    images = rng.gamma(0.5, 1e-3, (n_global, 51, 51, 25))
    b = {"images": images, "energy": rng.uniform(1.0, 2.0, n_global),
         "ecal": images.sum(axis=(1, 2, 3)), "angle": rng.uniform(1.2, 1.9, n_global),
         "_index": np.arange(n_global) + step * n_global}
    return {k: v[lo:hi] for k, v in b.items()}


def halves(rank, size, step):
    return rank * n_global // size, (rank + 1) * n_global // size


def all_or_nothing(rank, size, step):
    """Step 1: rank 0 has every event; step 2: rank 1 has; else halves."""
    if step in (1, 2):
        return (0, n_global) if rank == step - 1 else (0, 0)
    return halves(rank, size, step)


def train(reduction, comm, share=halves):
    keras.utils.set_random_seed(3)
    task = gan3d_keras.build(HPARAMS)
    task.reduction = reduction
    task.setup(comm, "cpu", "mpi", 0)
    start = [keras.ops.convert_to_numpy(w) for w in weights(task)]
    losses = []
    for step in range(steps):
        losses.append(task.train_step(batch(step, *share(comm.Get_rank(), comm.Get_size(), step))))
    return task, start, [keras.ops.convert_to_numpy(w) for w in weights(task)], losses


def weights(task):
    return [w for m in task.models().values() for w in m.trainable_weights]


def rel(a, b):
    """The largest difference of the final weights, relative to the largest move."""
    moved = max(float(np.max(np.abs(y - x))) for x, y in zip(a[1], a[2]))
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a[2], b[2])) / moved


clock = time.perf_counter()
tape2, fused2 = train("tape", world), train("fused", world)
tape1, fused1 = train("tape", MPI.COMM_SELF, halves), train("fused", MPI.COMM_SELF, halves)
block = world.Split(0, world.Get_size() - 1 - world.Get_rank())
empty_tape = train("tape", block, all_or_nothing)
result = {"np2_tape_vs_fused": rel(fused2, tape2), "np1_tape_vs_fused": rel(fused1, tape1),
          "tape_np2_vs_np1": rel(tape1, tape2),
          "block_with_zero_event_rank_vs_np1": rel(tape1, empty_tape),
          "losses_np2": [tape2[3], fused2[3]], "tapes_on": bool(tape2[0].tapes),
          "fused_is_distributed_optimizer": hasattr(fused2[0].d_opt, "_mpilearn"),
          "tape_opt_plain": not hasattr(tape2[0].d_opt, "_mpilearn"),
          "moved": max(float(np.max(np.abs(y - x))) for x, y in zip(tape2[1], tape2[2])),
          "seconds": time.perf_counter() - clock}
# every rank ends with the same weights
digest = float(sum(np.abs(w).sum() for w in tape2[2] + empty_tape[2]))
result["ranks_agree"] = len(set(world.allgather(digest))) == 1
if world.Get_rank() == 0:
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
