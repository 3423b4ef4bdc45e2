"""Allreduce cost per step vs one raw MPI_Allreduce of a single buffer of the same bytes.

    mpirun -np 2 python bench/allreduce_cost.py OUT   (writes OUT.json, OUT.md)

For the gradients of each model, measures (median of repeats, same run) the time mpilearn's
GradientReducer spends per step (pack into fused buckets, allreduce, average, unpack) and the
time of one raw ``comm.Allreduce`` on a numpy buffer holding the same number of bytes; also
raw allreduce time vs message size, for the scaling model.
"""
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gan3d  # noqa: E402

import mpilearn.torch as hvd  # noqa: E402
from common import median_seconds  # noqa: E402
from mpilearn.allreduce.fusion import GradientReducer  # noqa: E402

REPEATS = 30


def med(fn, comm):
    return median_seconds(fn, comm, REPEATS)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), 'results', 'allreduce_cost')
    ctx = hvd.init()
    comm = ctx.comm
    g, d = gan3d.angle_models()
    small_g, small_d = gan3d.small_angle_models()
    models = {"3DGAN angle G": g, "3DGAN angle D": d, "3DGAN small G": small_g,
              "mlp": torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                         torch.nn.Tanh(), torch.nn.Linear(32, 1))}
    rows = []
    for name, model in models.items():
        params = [p for p in model.parameters()]
        for p in params:
            p.grad = torch.randn_like(p)
        reducer = GradientReducer(params, hvd.get_backend("mpi", comm), comm.Get_size())
        nbytes = sum(p.numel() * 4 for p in params)
        buf = np.random.rand(nbytes // 4).astype(np.float32)
        from mpi4py import MPI

        ours = med(reducer.synchronize, comm)
        raw = med(lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM), comm)
        rows.append({"model": name, "bytes": nbytes, "mpilearn_ms": 1e3 * ours, "raw_ms": 1e3 * raw,
                     "ratio": ours / raw})
    sizes = []
    for exp in range(10, 25, 2):
        buf = np.zeros(2 ** exp // 4, np.float32)
        from mpi4py import MPI

        sizes.append({"bytes": 2 ** exp,
                      "raw_ms": 1e3 * med(lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM), comm)})
    if comm.Get_rank() == 0:
        json.dump({"np": comm.Get_size(), "rows": rows, "sizes": sizes}, open(out + ".json", "w"), indent=2)
        md = ["| gradients of | bytes | mpilearn fused allreduce (ms) | one raw MPI_Allreduce (ms) | ratio |",
              "|---|---|---|---|---|"]
        md += [f"| {r['model']} | {r['bytes']} | {r['mpilearn_ms']:.3f} | {r['raw_ms']:.3f} | {r['ratio']:.2f} |"
               for r in rows]
        md += ["", "| message bytes | raw MPI_Allreduce (ms) |", "|---|---|"]
        md += [f"| {s['bytes']} | {s['raw_ms']:.4f} |" for s in sizes]
        open(out + ".md", "w").write("\n".join(md) + "\n")
        print("\n".join(md))


if __name__ == "__main__":
    main()
