"""What measuring the gradient noise scale costs a 3DGAN training step (target: <= 1 %).

    mpirun -np 2 python bench/noise_scale_cost.py [--preset smooth] [--batch 16] [OUT]

Each rank builds the 3DGAN task as ``mpilearn.train`` does (its optimizers wrapped over the
job's ranks), then times whole training steps (the four updates, their allreduces, the host
read) in interleaved rounds: a round with every optimizer's noise-scale record attached, a
round without, alternating, on the same batches, so that a busy machine's drift falls on both
alike. The cost is the median step with it over the median step without, minus one; the spread
of the round-to-round medians says how far the difference can be trusted. Writes OUT.json /
OUT.md (default bench/results/noise_scale_cost).
"""
import argparse
import glob
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "models"))
from common import RESULTS, write  # noqa: E402


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default=os.path.join(RESULTS, "noise_scale_cost"))
    ap.add_argument("--preset", default="smooth", choices=("small", "smooth", "full"))
    ap.add_argument("--batch", type=int, default=16, help="events per rank per step")
    ap.add_argument("--steps", type=int, default=8, help="steps per round")
    ap.add_argument("--rounds", type=int, default=6, help="rounds with, and as many without")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: every rank on GPU 0 (the mpi backend stages through the host)")
    args = ap.parse_args()

    import torch

    import gan3d
    from mpilearn.allreduce.noise import NoiseScale
    from mpilearn.calo.simulate import simulate
    from mpilearn.core.comm import threads_per_rank
    from mpilearn.data.hdf5 import EventFiles
    import mpilearn.torch as hvd

    ctx = hvd.init()
    comm = ctx.comm
    torch.set_num_threads(threads_per_rank(ctx))
    folder = comm.bcast(tempfile.mkdtemp() if comm.Get_rank() == 0 else None)
    events = args.batch * comm.Get_size() * 4
    if comm.Get_rank() == 0:
        simulate(folder, events, "angle", (100, 200), 7, events, progress=False)
    comm.Barrier()
    task = gan3d.build({"preset": args.preset})
    task.halves_every = 16  # train.noise_scale.halves_every's default: one rank's measure
    backend = "mpi"  # on one GPU too: the registry has no nccl; one rank reduces nothing
    task.setup(comm, args.device, backend, 25 << 20)
    data = EventFiles(sorted(glob.glob(f"{folder}/*.h5")), task.keys, task.optional_keys)
    rank, size = comm.Get_rank(), comm.Get_size()
    batches = [task.transform(data.read(np.arange(k * args.batch * size + rank * args.batch,
                                                  k * args.batch * size + (rank + 1) * args.batch)))
               for k in range(4)]
    reducers = [opt._reducer for opt in task.optimizers().values()]
    records = [r.noise for r in reducers]

    def round_(on: bool) -> list:
        for r, rec in zip(reducers, records):
            r.noise = rec if on else None
        times = []
        for k in range(args.steps):
            comm.Barrier()
            start = time.perf_counter()
            task.train_step(batches[k % len(batches)])
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return times

    round_(True), round_(False)  # warm-up (the optimizers' state exists from here on)
    rounds = {True: [], False: []}
    for _ in range(args.rounds):
        for on in (True, False):
            rounds[on].append(round_(on))
    if rank != 0:
        return
    med = {on: float(np.median(np.concatenate(rounds[on]))) for on in rounds}
    per_round = [np.median(a) / np.median(b) - 1 for a, b in zip(rounds[True], rounds[False])]
    cost = med[True] / med[False] - 1
    est = {name: rec.estimate(args.batch, args.batch * size)
           for name, rec in zip(task.optimizers(), records) if rec is not None and rec.take(0) >= 0}
    # the estimates only show that the records were live; a few steps are no measurement
    data_out = {"np": size, "preset": args.preset, "batch": args.batch, "steps": args.steps,
                "rounds": args.rounds, "median_step_s": {"with": med[True], "without": med[False]},
                "cost": cost, "cost_per_round": per_round, "estimates": est,
                "cpu": cpu_name(), "device": args.device,
                "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None}
    md = [f"3DGAN {args.preset} preset, np = {size}, {args.batch} events per rank per step, "
          f"{args.rounds} interleaved rounds of {args.steps} steps each way; CPU: {data_out['cpu']}"
          + (f"; GPU: {data_out['gpu']} ({backend} backend)" if data_out["gpu"] else ""), "",
          "| median step with the noise scale (s) | without (s) | cost | per-round costs (min .. max) | target <= 1 % |",
          "|---|---|---|---|---|",
          f"| {med[True]:.4f} | {med[False]:.4f} | {100 * cost:+.2f} % | "
          f"{100 * min(per_round):+.2f} % .. {100 * max(per_round):+.2f} % | "
          f"{'met' if cost <= 0.01 else 'missed'} |"]
    write(args.out, data_out, md)


if __name__ == "__main__":
    main()
