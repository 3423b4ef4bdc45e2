"""Exercises the Horovod-shaped collectives on every rank; exits non-zero on a mismatch."""
import sys

import torch

import mpilearn.torch as hvd

backend = sys.argv[1]
hvd.init()
r, n = hvd.rank(), hvd.size()
assert hvd.local_size() == n and hvd.local_rank() == r  # one node
t = torch.arange(5, dtype=torch.float32) + r
avg = hvd.allreduce(t, backend=backend)
assert torch.allclose(avg, torch.arange(5.0) + (n - 1) / 2), avg
s = hvd.allreduce(t, op=hvd.Sum, backend=backend)
assert torch.allclose(s, n * torch.arange(5.0) + n * (n - 1) / 2), s
assert torch.equal(t, torch.arange(5, dtype=torch.float32) + r)  # input untouched
obj = hvd.broadcast_object({"rank": r, "list": [r] * 3}, root_rank=n - 1)
assert obj == {"rank": n - 1, "list": [n - 1] * 3}, obj
half = torch.full((3,), float(r), dtype=torch.bfloat16)
hvd.broadcast_parameters([half], root_rank=n - 1)
assert torch.equal(half, torch.full((3,), float(n - 1), dtype=torch.bfloat16))
model = torch.nn.Linear(3, 2)
opt = torch.optim.Adam(model.parameters(), lr=0.1 * (r + 1))
model(torch.randn(4, 3)).sum().backward()
opt.step()  # creates per-rank state
hvd.broadcast_parameters(model.state_dict(), 0)
hvd.broadcast_optimizer_state(opt, 0)
assert opt.param_groups[0]["lr"] == 0.1
print("ok", r)
