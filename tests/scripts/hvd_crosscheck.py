"""The same Horovod-API calls, run with ``horovod.torch`` or ``mpilearn.torch`` (argv[1]); each
rank saves every result to ``argv[2].<rank>.npz`` so that a test can compare the two
libraries value by value (semantics, not only our reading of the docs)."""
import importlib
import os
import sys

import numpy as np
import torch

os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
hvd = importlib.import_module(sys.argv[1])
hvd.init()
R, N = hvd.rank(), hvd.size()
out = {}


def keep(name, value):
    if isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            keep(f"{name}.{i}", v)
        return
    if torch.is_tensor(value):
        value = value.detach()
        out[name + ".dtype"] = np.array(str(value.dtype))
        value = value.to(torch.float64) if value.dtype in (torch.bfloat16, torch.float16) else value
        value = value.numpy()
    out[name] = np.asarray(value)


g = torch.Generator().manual_seed(R)
x = torch.randn(2 * N + 1, 3, generator=g, dtype=torch.float64)
ints = torch.arange(5, dtype=torch.int32) * (R + 1) - 3

keep("allreduce.avg", hvd.allreduce(x))
keep("allreduce.sum", hvd.allreduce(x, op=hvd.Sum))
keep("allreduce.min", hvd.allreduce(x, op=hvd.Min))
keep("allreduce.max", hvd.allreduce(x, op=hvd.Max))
keep("allreduce.prod", hvd.allreduce(x, op=hvd.Product))
keep("allreduce.scaled", hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0))
keep("allreduce.avg_scaled", hvd.allreduce(x, prescale_factor=0.5, postscale_factor=3.0))
keep("allreduce.int_sum", hvd.allreduce(ints, op=hvd.Sum))
keep("allreduce.int_avg_same", hvd.allreduce(torch.full((3,), 6 * N, dtype=torch.int64)))
keep("allreduce.half", hvd.allreduce(x.half(), op=hvd.Sum))
keep("allreduce.fp16_compression", hvd.allreduce(x, compression=hvd.Compression.fp16))
keep("allreduce.average_false", hvd.allreduce(x, average=False))
keep("grouped_allreduce", hvd.grouped_allreduce([x, ints.double()], op=hvd.Sum))

v = torch.randn(R + 1, 2, generator=g, dtype=torch.float64, requires_grad=True)
gathered = hvd.allgather(v)
keep("allgather", gathered)
gathered.backward(torch.arange(gathered.numel(), dtype=torch.float64).reshape(gathered.shape) * (R + 1))
keep("allgather.grad", v.grad)
keep("grouped_allgather", hvd.grouped_allgather([v.detach(), ints]))

b = x.clone().requires_grad_()
bb = hvd.broadcast(b, root_rank=N - 1)
keep("broadcast", bb)
bb.backward(torch.ones_like(bb) * (R + 2))
keep("broadcast.grad", b.grad)

a = torch.arange(3.0 * N, dtype=torch.float64).reshape(N, 3) + 100 * R
keep("alltoall.even", hvd.alltoall(a))
splits = torch.tensor([(R + d) % 2 for d in range(N)], dtype=torch.int32)
rows = torch.arange(float(int(splits.sum()) * 2), dtype=torch.float64).reshape(-1, 2) + 10 * R
aa = rows.clone().requires_grad_()
res, received = hvd.alltoall(aa, splits=splits)
keep("alltoall.splits", res)
keep("alltoall.received", received)
res.backward(torch.ones_like(res) * (R + 1))
keep("alltoall.grad", aa.grad)

for name, op in (("sum", hvd.Sum), ("avg", hvd.Average)):
    s = x.clone().requires_grad_()
    rs = hvd.reducescatter(s, op=op)
    keep(f"reducescatter.{name}", rs)
    rs.backward(torch.ones_like(rs) * (R + 1))
    keep(f"reducescatter.{name}.grad", s.grad)
r = x.clone().requires_grad_()
ar = hvd.allreduce(r, op=hvd.Sum, prescale_factor=2.0)
ar.backward(torch.ones_like(ar) * (R + 1))
keep("allreduce.grad", r.grad)

keep("broadcast_object", np.array(hvd.broadcast_object({"r": R}, root_rank=N - 1)["r"]))
keep("allgather_object", np.array([o["r"] for o in hvd.allgather_object({"r": R})]))

# the optimizer: fp16 compression with a predivide factor, then 2 accumulated passes
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                               compression=hvd.Compression.fp16, gradient_predivide_factor=2.0)
for step in range(3):
    opt.zero_grad()
    model(x[:, :3] * (step + 1)).pow(2).mean().backward()
    opt.step()
keep("optimizer.fp16_predivide", [p for p in model.parameters()])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters(), backward_passes_per_step=2,
                               op=hvd.Sum)
for step in range(2):
    opt.zero_grad()
    for k in range(2):
        model(x[:, :3] + k).pow(2).mean().backward()
    opt.step()
keep("optimizer.bpps_sum", [p for p in model.parameters()])

if N > 1:
    ps = hvd.add_process_set([r for r in range(N) if r != 0])
    if ps.included():
        keep("process_set.allreduce", hvd.allreduce(x, op=hvd.Sum, process_set=ps))
        keep("process_set.broadcast", hvd.broadcast(x, root_rank=N - 1, process_set=ps))
        keep("process_set.allgather", hvd.allgather(v.detach(), process_set=ps))
        keep("process_set.rank", np.array([ps.rank(), ps.size()]))
    hvd.remove_process_set(ps)

# uneven work, then join (named: Horovod matches unnamed ops by per-rank counters, which the
# process-set ops above put out of step)
for step in range(R + 1):
    keep(f"join.step{step}", hvd.allreduce(torch.ones(2, dtype=torch.float64) * (R + 1), op=hvd.Sum,
                                          name=f"join.{step}"))
keep("join.last", np.array(hvd.join()))
np.savez(f"{sys.argv[2]}.{R}.npz", **out)
print("saved", R, len(out), flush=True)
