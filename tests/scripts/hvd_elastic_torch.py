"""An elastic PyTorch script written against Horovod's API (hvd.elastic.run, TorchState,
ElasticSampler, commit, reset callbacks): with ``import horovod.torch as hvd`` it is a Horovod
elastic script. ``MPILEARN_TEST_KILL=R:B``: world rank R dies by SIGKILL at its batch B of
the first epoch. Rank 0 prints the final state as JSON: how often each sample was trained,
the weights' sum and the final size."""
import json
import os
import signal

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import mpilearn.torch as hvd

EPOCHS, BATCH, SAMPLES, LR = 2, 4, 240, 0.05

hvd.init()
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
x = torch.randn(SAMPLES, 8)
dataset = TensorDataset(torch.arange(SAMPLES), x, x.sum(1, keepdim=True))

model = torch.nn.Linear(8, 1)
model.register_buffer("seen", torch.zeros(SAMPLES))
optimizer = torch.optim.SGD(model.parameters(), lr=LR * hvd.size())
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=1)
loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
victim = [int(v) for v in os.environ.get("MPILEARN_TEST_KILL", "-1:-1").split(":")]
world_rank = hvd.rank()
resets = []


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, EPOCHS):
        for batch_idx, (idx, data, target) in enumerate(loader):
            if (world_rank, state.epoch, state.batch) == (victim[0], 0, victim[1]):
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            loss = F.mse_loss(model(data), target)
            loss.backward()
            optimizer.step()
            counts = torch.zeros(SAMPLES)
            counts[idx] = 1.0
            model.seen += hvd.allreduce(counts, op=hvd.Sum, name="seen")
            state.batch += 1
            state.sampler.record_batch(batch_idx, BATCH)
            state.commit()
        state.batch = 0
        state.sampler.set_epoch(state.epoch + 1)


def on_state_reset():
    resets.append(hvd.size())
    for group in optimizer.param_groups:
        group["lr"] = LR * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)
if hvd.rank() == 0:
    print(json.dumps({"seen": sorted(set(model.seen.tolist())), "size": hvd.size(),
                      "resets": resets, "weight_sum": float(model.weight.detach().sum())}), flush=True)
