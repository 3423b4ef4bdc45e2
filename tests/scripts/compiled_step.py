"""Trains a task a few steps eagerly, compiled (train.compile=default) and channels-last, in
float64 from the same weights on the same batches, and saves rank 0's results.

usage: compiled_step.py mlp|gan LOCAL_BATCH STEPS OUT.npz [cpu|cuda]
Rank r trains on rows [r*b, (r+1)*b) of each global batch. Saved per variant: the weights
(``VARIANT/model/name``), the step losses, the buckets launched from backward's hooks
(``VARIANT/overlapped``) and whether any state_dict key has a compile prefix.
"""
import os
import sys

import numpy as np
import torch
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "models"))
import gan3d  # noqa: E402
import mlp  # noqa: E402

from mpilearn.calo.format import Preprocess  # noqa: E402

kind, b, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
comm = MPI.COMM_WORLD
r, n = comm.Get_rank(), comm.Get_size()
device = sys.argv[5] if len(sys.argv) > 5 else "cpu"
if device == "cuda":  # ranks may share the GPU: the mpi backend stages through the host
    device = f"cuda:{r % torch.cuda.device_count()}"
rng = np.random.default_rng(0)
G = b * n
if kind == "mlp":
    X, Y = rng.normal(size=(steps, G, 8)), rng.normal(size=(steps, G, 1))
    batches = [{"X": X[s, r * b:(r + 1) * b], "y": Y[s, r * b:(r + 1) * b]} for s in range(steps)]
else:
    batches = []
    for s in range(steps):
        raw = {"ECAL": rng.random((G, 51, 51, 25), dtype=np.float32) * 1.2,
               "energy": rng.uniform(100, 200, G), "mtheta": rng.uniform(1.0, 2.1, G),
               "_index": np.arange(s * G, (s + 1) * G)}
        batches.append(Preprocess("angle")({k: v[r * b:(r + 1) * b] for k, v in raw.items()}))


def build():
    torch.manual_seed(0)
    if kind == "mlp":
        task = mlp.build({})
        task.model.double()
        task.dtype = torch.float64
        return task
    return gan3d.build({"preset": "small", "dtype": "float64", "dropout": 0.0})


variants = [("eager", "off", "false"), ("compiled", "default", "false")]
if kind == "gan":
    variants.append(("channels_last", "off", "true"))
saved = {}
for name, mode, layout in variants:
    task = build()
    task.compile_mode, task.channels_last = mode, layout
    task.setup(comm, device, "mpi", 16 << 10)  # small buckets: several, launched in order
    losses = [task.train_step(batch) for batch in batches]
    state = task.state_dict()["models"]
    for model, params in state.items():
        for k, v in params.items():
            saved[f"{name}/{model}/{k}"] = v.detach().cpu().numpy()
    saved[f"{name}/losses"] = np.array([[v for _, v in sorted(l.items())] for l in losses])
    saved[f"{name}/overlapped"] = np.array(sum(o._reducer.overlapped for o in task.optimizers().values()))
    saved[f"{name}/prefixed"] = np.array(any("_orig_mod" in k for p in state.values() for k in p))
if r == 0:
    np.savez(out, **saved)
