"""Eager and train.compile=default steps of the full angle 3DGAN, interleaved (so that a shared
machine's changing load hits both alike): GANTask.train_step, batch 8, fp32, 1 process, 2 threads.

    python bench/gan_compile_paired.py [PAIRS]
"""
import os
import sys
import time

import numpy as np, torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"))
import gan3d
from mpilearn.calo.format import Preprocess
torch.set_num_threads(2)
rng = np.random.default_rng(0)
batch = Preprocess("angle")({"ECAL": rng.random((8, 51, 51, 25), dtype=np.float32) * 1.2,
                             "energy": rng.uniform(100, 200, 8), "mtheta": rng.uniform(1.0, 2.1, 8),
                             "_index": np.arange(8)})
tasks = {}
for mode in ("off", "default"):
    torch.manual_seed(0)
    t = gan3d.build({"preset": "full"})
    t.compile_mode = mode
    t.setup(None, "cpu", "mpi", 25 << 20, distributed=False)
    s = time.time(); t.train_step(batch); print(mode, "first step (compile)", round(time.time() - s, 1), flush=True)
    tasks[mode] = t
times = {"off": [], "default": []}
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for mode, t in tasks.items():
        s = time.perf_counter(); t.train_step(batch); times[mode].append(time.perf_counter() - s)
        print(mode, round(times[mode][-1], 2), flush=True)
for mode, v in times.items():
    print(mode, "median s/step", round(float(np.median(v)), 2), "events/s", round(8 / float(np.median(v)), 3))
