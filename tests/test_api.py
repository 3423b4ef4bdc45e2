"""The Horovod-shaped API, single-process and under mpirun, for each backend."""
import pytest
import torch

from mpilearn.allreduce import available_backends
from mpilearn.allreduce.fusion import make_buckets

from conftest import TESTS, mpirun


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("n", [1, 3])
def test_collectives(backend, n):
    proc = mpirun(n, [f"{TESTS}/scripts/api.py", backend], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ok") == n


def test_buckets_respect_threshold_and_reverse_order():
    params = [torch.nn.Parameter(torch.zeros(k)) for k in (10, 20, 30, 40)]
    buckets = make_buckets(params, threshold_bytes=200)  # 50 floats per bucket
    assert [[p.numel() for p in b.params] for b in buckets] == [[40], [30, 20], [10]]
    assert sum(b.numel for b in buckets) == 100
    one = make_buckets(params, threshold_bytes=1 << 20)
    assert len(one) == 1 and one[0].buffer.numel() == 100


def test_distributed_optimizer_keeps_class_and_state_dict():
    import mpilearn.torch as hvd

    hvd.init()
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    assert isinstance(opt, torch.optim.SGD)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model(torch.ones(1, 2)).sum().backward()
    before = model.weight.detach().clone()
    opt.step()
    sched.step()
    assert torch.allclose(model.weight, before - 0.5)  # size 1: the gradient itself
    assert opt.param_groups[0]["lr"] == 0.25
    assert "state" in opt.state_dict()
