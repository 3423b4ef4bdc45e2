"""DistributedOptimizer and SyncBatchNorm against single-process references that every rank
computes locally on the whole data (float64, so the comparison is tight). Prints "ok NAME"."""
import warnings

import torch

import mpilearn.torch as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


def model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def batches(steps, rows):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(rows, 4, generator=g), torch.randn(rows, 1, generator=g))
            for _ in range(steps)]


def ok(name):
    print(f"ok {name} rank {R}", flush=True)


def reference(data, optimizer, lr):
    """The model trained by one process on the whole of every global batch."""
    net = model()
    opt = optimizer(net.parameters(), lr=lr)
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return net


def test_backward_passes_per_step():
    b, passes, steps = 3, 4, 3
    data = batches(steps, b * passes * N)   # one global batch per step
    ref = reference(data, torch.optim.SGD, 0.1)
    net = model()
    dopt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                    named_parameters=net.named_parameters(),
                                    backward_passes_per_step=passes)
    for x, y in data:
        dopt.zero_grad()
        mine = slice(R * b * passes, (R + 1) * b * passes)
        for k in range(passes):  # Horovod's recipe: scale each pass's loss by 1/passes
            part = slice(mine.start + k * b, mine.start + (k + 1) * b)
            (torch.nn.functional.mse_loss(net(x[part]), y[part]) / passes).backward()
        dopt.step()
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-10, atol=1e-12), (p - q).abs().max()
    ok("backward_passes_per_step")


def test_sync_batch_norm():
    b = 5
    x = torch.randn(b * N, 3, 4, generator=torch.Generator().manual_seed(3))
    ref = torch.nn.BatchNorm1d(3)
    sync = hvd.SyncBatchNorm(3)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
        sync.weight.copy_(ref.weight)
    upstream = torch.randn(b * N, 3, 4, generator=torch.Generator().manual_seed(4))
    xr = x.clone().requires_grad_()
    expected = ref(xr)
    (expected * upstream).sum().backward()
    xs = x[R * b:(R + 1) * b].clone().requires_grad_()
    out = sync(xs)
    (out * upstream[R * b:(R + 1) * b]).sum().backward()
    assert torch.allclose(out, expected[R * b:(R + 1) * b].detach(), atol=1e-12)
    assert torch.allclose(xs.grad, xr.grad[R * b:(R + 1) * b], atol=1e-12), "input gradient"
    wgrad = hvd.allreduce(sync.weight.grad, op=hvd.Sum)
    assert torch.allclose(wgrad, ref.weight.grad, atol=1e-12), "weight gradient"
    assert torch.allclose(sync.running_mean, ref.running_mean, atol=1e-12)
    assert torch.allclose(sync.running_var, ref.running_var, atol=1e-12)
    sync.eval()
    ref.eval()
    assert torch.allclose(sync(x), ref(x), atol=1e-12)
    ok("SyncBatchNorm")


def test_semantics():
    net = model()
    base = torch.optim.SGD(net.parameters(), lr=0.1)
    named = list(net.named_parameters())
    for bad, needle in ((named + [named[0]], "unique"), (named[1:], "not named"),
                        ([p for _, p in named], "tuples")):
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                     named_parameters=bad)
            raise AssertionError(f"no ValueError ({needle})")
        except ValueError as e:
            assert needle in str(e), e
    for kwargs in ({"op": hvd.Sum, "gradient_predivide_factor": 2.0},
                   {"backward_passes_per_step": 0}):
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), **kwargs)
            raise AssertionError(f"no ValueError for {kwargs}")
        except ValueError:
            pass
    opt = hvd.DistributedOptimizer(base, named_parameters=net.named_parameters())
    assert isinstance(opt, torch.optim.SGD)
    x, y = batches(1, 2)[0]
    torch.nn.functional.mse_loss(net(x), y).backward()
    if N > 1:  # Horovod registers its hooks only when there is more than one rank
        try:
            opt.zero_grad()
            raise AssertionError("zero_grad between backward and step must be an AssertionError")
        except AssertionError as e:
            assert "zero_grad() was called after loss.backward()" in str(e), e
        try:
            torch.nn.functional.mse_loss(net(x), y).backward()
            raise AssertionError("a second backward must be an AssertionError")
        except AssertionError as e:
            assert "more than backward_passes_per_step" in str(e), e
    # synchronize, clip, then step inside skip_synchronize: the Horovod clipping recipe
    opt.synchronize()
    grads = [p.grad.clone() for p in net.parameters()]
    for g in grads:
        assert torch.allclose(hvd.allreduce(g), g)  # averaged: equal on every rank
    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.01)
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()  # without skip_synchronize: Horovod warns and synchronizes again
    assert any("skip_synchronize" in str(w.message) for w in caught)
    ok("optimizer semantics")


def test_groups_and_sum():
    data = batches(2, 2 * N)
    results = []
    for kwargs in ({}, {"num_groups": 2}, {"groups": "layers"}, {"op": hvd.Sum},
                   {"compression": hvd.Compression.bf16}):
        net = model()
        if kwargs.get("groups") == "layers":
            kwargs = {"groups": [list(net[0].parameters()), list(net[2].parameters())]}
        lr = 0.1 / N if kwargs.get("op") == hvd.Sum else 0.1
        opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=lr), **kwargs)
        for x, y in data:
            opt.zero_grad()
            mine = slice(2 * R, 2 * R + 2)
            torch.nn.functional.mse_loss(net(x[mine]), y[mine]).backward()
            opt.step()
        results.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    for r in results[1:4]:
        assert torch.allclose(r, results[0], rtol=1e-10, atol=1e-12)
    assert torch.allclose(results[4], results[0], rtol=1e-2, atol=1e-3)  # bf16 on the wire
    ok("groups, num_groups, Sum, bf16")


def test_unused_and_sparse():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    head = torch.nn.Linear(3, 1)
    unused = torch.nn.Linear(2, 2)
    params = list(emb.parameters()) + list(head.parameters()) + list(unused.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1))
    hvd.broadcast_parameters(params, root_rank=0)
    idx = torch.tensor([R % 10, (R + 3) % 10])
    head(emb(idx)).sum().backward()
    opt.step()
    assert unused.weight.grad is not None and torch.all(unused.weight.grad == 0)
    assert emb.weight.grad.is_sparse  # sparse in, sparse out (sparse_as_dense=False)
    dense = emb.weight.grad.to_dense()
    assert torch.allclose(hvd.allreduce(dense), dense)
    ok("unused and sparse gradients")


def test_gradients_are_bucket_views():
    """Gradients live in the fusion buffers, and every way user code has of replacing them
    (zero_grad(set_to_none), the module's zero_grad, a fresh tensor before backward, a new
    tensor after it) still gives the reference result."""
    steps = 5
    data = batches(steps, 2 * N)
    ref = reference(data, torch.optim.Adam, 0.01)
    net = model()
    dopt = hvd.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=0.01),
                                    fusion_threshold_bytes=128)  # several buckets
    buffers = [b.buffer for b in dopt._reducer.buckets]
    assert len(buffers) > 1

    def in_a_buffer(grad):
        return any(b.data_ptr() <= grad.data_ptr() < b.data_ptr() + b.numel() * b.element_size()
                   for b in buffers)

    for step, (x, y) in enumerate(data):
        if step == 1:
            net.zero_grad()  # the module's: set_to_none, behind the optimizer's back
        elif step == 2:
            for p in net.parameters():
                p.grad = torch.zeros_like(p)  # user code that brings its own tensors
        else:
            dopt.zero_grad()
            if step > 0:
                assert all(in_a_buffer(p.grad) and not p.grad.any() for p in net.parameters())
        mine = slice(2 * R, 2 * R + 2)
        torch.nn.functional.mse_loss(net(x[mine]), y[mine]).backward()
        if step == 3:
            for p in net.parameters():
                p.grad = p.grad.clone()  # replaced after backward: the reduced value wins
        dopt.step()
        assert all(in_a_buffer(p.grad) for p in net.parameters()), f"step {step}"
        for p in net.parameters():
            assert torch.equal(hvd.allreduce(p.grad, op=hvd.Sum), p.grad * N)  # same everywhere
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-10, atol=1e-12), (p - q).abs().max()
    ok("gradients are bucket views")


for test in (test_backward_passes_per_step, test_sync_batch_norm, test_semantics,
             test_groups_and_sum, test_unused_and_sparse, test_gradients_are_bucket_views):
    test()
