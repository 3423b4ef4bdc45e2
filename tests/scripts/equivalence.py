"""Runs k steps of data-parallel training through mpilearn.torch and saves rank 0's weights.

usage: equivalence.py BACKEND OPTIMIZER LOCAL_BATCH STEPS OUT.npz [DEVICE]
Rank r of N trains on rows [r*b, (r+1)*b) of each global batch of N*b rows, so N ranks with
local batch b must give the same weights as 1 rank with batch N*b.
"""
import sys

import numpy as np
import torch

import mpilearn.torch as hvd

backend, opt_name, b, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
device = sys.argv[6] if len(sys.argv) > 6 else "cpu"
hvd.init()
r, n = hvd.rank(), hvd.size()
if device == "cuda":  # Horovod's recipe; modulo: the staged mpi backend lets ranks share a GPU
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
torch.manual_seed(1234 + r)  # different initial weights per rank: the broadcast must fix this
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                            torch.nn.Tanh(), torch.nn.Linear(16, 2)).to(device)
if opt_name == "sgd":
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
else:
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)
# small fusion threshold: several buckets, so the ordering logic is exercised
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), backend=backend,
                               fusion_threshold_bytes=512)
rng = np.random.default_rng(0)
G = b * n
X = torch.tensor(rng.normal(size=(steps, 8 * 4, 6)), dtype=torch.float32)  # 32 rows per step max
Y = torch.tensor(rng.normal(size=(steps, 8 * 4, 2)), dtype=torch.float32)
assert G <= X.shape[1]
for s in range(steps):
    x, y = X[s, r * b:(r + 1) * b].to(device), Y[s, r * b:(r + 1) * b].to(device)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
if r == 0:
    np.savez(out, *[p.detach().cpu().numpy() for p in model.parameters()])
