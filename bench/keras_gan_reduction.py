"""The Keras 3DGAN's two reductions on TensorFlow, paired: four DistributedGradientTapes
(``hparams.reduction=tape``, the default) vs the fused path (``fused``: the wrapped Keras
optimizers reduce inside ``apply``), small preset, np=1 and 2, global batch 16.

    python bench/keras_gan_reduction.py [--quick] [--out bench/results/keras_gan_reduction]

Both tasks live in the same processes and take turns (R rounds of S steps each), so that the
machine's load hits them alike; the median step time of each is reported.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def worker(rounds: int, steps: int, out: str) -> None:
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import numpy as np
    from mpi4py import MPI

    from mpilearn.models import gan3d_keras

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n_global = 16

    def batch(step):
        rng = np.random.default_rng(step)
        images = rng.gamma(0.5, 1e-3, (n_global, 51, 51, 25)).astype("float32")
        b = {"images": images, "energy": rng.uniform(1.0, 2.0, n_global),
             "ecal": images.sum(axis=(1, 2, 3)), "angle": rng.uniform(1.2, 1.9, n_global),
             "_index": np.arange(n_global) + step * n_global}
        part = slice(rank * n_global // size, (rank + 1) * n_global // size)
        return {k: v[part] for k, v in b.items()}

    tasks = {}
    for reduction in ("tape", "fused"):
        keras.utils.set_random_seed(0)
        tasks[reduction] = gan3d_keras.build({"preset": "small", "reduction": reduction})
        tasks[reduction].setup(comm, "cpu", "mpi", 0)
        tasks[reduction].train_step(batch(0))  # the trace
    times = {k: [] for k in tasks}
    for r in range(rounds):
        for name in (("tape", "fused") if r % 2 == 0 else ("fused", "tape")):
            for s in range(steps):
                comm.Barrier()
                start = time.perf_counter()
                tasks[name].train_step(batch(1 + s))
                times[name].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({k: float(np.median(v)) for k, v in times.items()}, f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=os.path.join(HERE, "results", "keras_gan_reduction"))
    p.add_argument("--worker", nargs=3, metavar=("ROUNDS", "STEPS", "OUT"))
    a = p.parse_args()
    if a.worker:
        return worker(int(a.worker[0]), int(a.worker[1]), a.worker[2])
    rounds, steps = (2, 2) if a.quick else (6, 4)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "tensorflow",
           "PYTHONPATH": REPO, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    sys.path.insert(0, HERE)
    from common import write

    rows, lines = [], ["| np | tapes ms/step | fused ms/step | fused / tapes speed |",
                       "|---|---|---|---|"]
    for np_ in (1, 2):
        out = os.path.join(tempfile.mkdtemp(prefix="mpilearn-bench-"), "r.json")
        subprocess.run(["mpirun", "-np", str(np_), "--oversubscribe", "-x", "PYTHONPATH",
                        sys.executable, __file__, "--worker", str(rounds), str(steps), out],
                       check=True, env=env, cwd=REPO)
        r = json.load(open(out))
        rows.append({"np": np_, **r})
        lines.append(f"| {np_} | {1e3 * r['tape']:.0f} | {1e3 * r['fused']:.0f} | "
                     f"{r['tape'] / r['fused']:.3f} |")
    lines += ["", f"Small preset, float32, global batch 16, {rounds} alternating rounds of "
              f"{steps} steps per reduction, median step (slowest rank)."]
    write(a.out, rows, lines)


if __name__ == "__main__":
    main()
