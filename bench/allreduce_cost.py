"""Allreduce cost per step vs one raw MPI_Allreduce of a single buffer of the same bytes.

    mpirun -np N python bench/allreduce_cost.py [OUT]   (writes OUT_npN.json, OUT_npN.md)

For the gradients of each model, measures (median of repeats, same run) everything
mpilearn's GradientReducer does in one step once backward has written the gradients: the
post-accumulate-grad hook of every parameter in backward order (the 1/N folded into the
gradient, bucket launch) and ``synchronize()`` (the allreduce of each fused bucket, in place,
and the gradients handed back as views), against one raw ``comm.Allreduce`` on a numpy
buffer of the same bytes. Also: the per-bucket fixed cost (total minus raw) and raw
allreduce time against message size, which bench/scaling_model.py fits.
"""
import os
import sys

import numpy as np
import torch
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gan3d  # noqa: E402

import mpilearn.torch as hvd  # noqa: E402
from common import RESULTS, median_seconds, write  # noqa: E402
from mpilearn.allreduce.fusion import GradientReducer  # noqa: E402
from mpilearn.core.comm import threads_per_rank  # noqa: E402

REPEATS = 40


def step_cost(model, comm, average):
    """(hook seconds, whole step seconds, buckets, bytes) of one reducer step, medians."""
    params = list(model.parameters())
    reducer = GradientReducer(params, hvd.get_backend("mpi", comm), comm.Get_size(),
                              average=average)
    for p in params:
        p.grad = torch.randn_like(p)
    reducer.synchronize()  # binds the gradients to the bucket views, as after a first step

    def hooks():  # what backward's post-accumulate-grad hooks run, in backward order
        for p in reversed(params):
            reducer._on_grad(p)

    def step():
        hooks()
        reducer.synchronize()

    total = median_seconds(step, comm, REPEATS, warmup=3)
    hook = median_seconds(hooks, comm, REPEATS, after=reducer.synchronize)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return hook, total, len(reducer.buckets), nbytes


def main():
    ctx = hvd.init()
    comm, n = ctx.comm, ctx.comm.Get_size()
    torch.set_num_threads(threads_per_rank(ctx))  # as mpilearn.train does: cores / ranks
    out = (sys.argv[1] if len(sys.argv) > 1 else os.path.join(RESULTS, "allreduce_cost")) + f"_np{n}"
    g, d = gan3d.angle_models()
    small_g, _ = gan3d.small_angle_models()
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                              torch.nn.Tanh(), torch.nn.Linear(32, 1))
    models = {"3DGAN angle G": g, "3DGAN angle D": d, "3DGAN small G": small_g, "mlp": mlp}
    targets = {"3DGAN angle G", "3DGAN angle D", "3DGAN small G"}
    rows = []
    for name, model in models.items():
        for op in ("Average", "Sum"):
            hook, total, buckets, nbytes = step_cost(model, comm, op == "Average")
            buf = np.random.rand(nbytes // 4).astype(np.float32)
            raw = median_seconds(lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM), comm,
                                 REPEATS, warmup=3)
            rows.append({"model": name, "op": op, "bytes": nbytes, "buckets": buckets,
                         "hook_ms": 1e3 * hook, "mpilearn_ms": 1e3 * total, "raw_ms": 1e3 * raw,
                         "ratio": total / raw, "per_bucket_overhead_ms": 1e3 * (total - raw) / buckets,
                         "target": name in targets})
    sizes = []
    for exp in range(10, 25, 2):
        buf = np.zeros(2 ** exp // 4, np.float32)
        sizes.append({"bytes": 2 ** exp, "raw_ms": 1e3 * median_seconds(
            lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM), comm, REPEATS, warmup=3)})
    if comm.Get_rank() == 0:
        md = [f"np = {n}. mpilearn = the whole reducer step after backward (hooks + synchronize); "
              "'hooks' is the part spent in the gradient hooks (1/N scaling, bucket launch). "
              "op=Sum: the 1/N is folded into the loss scale, as mpilearn.train's 3DGAN runs; "
              "op=Average multiplies the bucket once (the Horovod API's default).", "",
              "| gradients of | op | bytes | buckets | hooks (ms) | mpilearn step (ms) | one raw MPI_Allreduce (ms) "
              "| ratio | target <= 1.2 |", "|---|---|---|---|---|---|---|---|---|"]
        md += [f"| {r['model']} | {r['op']} | {r['bytes']} | {r['buckets']} | {r['hook_ms']:.3f} | {r['mpilearn_ms']:.3f} "
               f"| {r['raw_ms']:.3f} | {r['ratio']:.2f} | "
               f"{('met' if r['ratio'] <= 1.2 else 'missed') if r['target'] else '-'} |" for r in rows]
        md += ["", "| message bytes | raw MPI_Allreduce (ms) |", "|---|---|"]
        md += [f"| {s['bytes']} | {s['raw_ms']:.4f} |" for s in sizes]
        write(out, {"np": n, "rows": rows, "sizes": sizes}, md)


if __name__ == "__main__":
    main()
