"""Every collective of mpilearn.torch against a numpy reference, on every rank, for every
dtype and op (run under mpirun with 2, 3 or 4 ranks). Each rank builds every rank's input
from a seed, so it knows the expected result without communicating. Prints "ok NAME".
MPILEARN_TEST_DEVICE=cuda puts the inputs on the GPU."""
import os
import sys

import numpy as np
import torch

import mpilearn.torch as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()
DEVICE = os.environ.get("MPILEARN_TEST_DEVICE", "cpu")
torch.set_default_device(DEVICE)  # every tensor below, not only data()'s
INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
OPS = {hvd.Sum: np.sum, hvd.Average: None, hvd.Min: np.min, hvd.Max: np.max,
       hvd.Product: np.prod}


def data(rank, dtype, shape, seed=0):
    """Rank ``rank``'s input: small values so that sums and products stay exact."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, device="cpu").bool().to(DEVICE)
    lo = 0 if dtype == torch.uint8 else -3
    return torch.randint(lo, 4, shape, generator=g, device="cpu").to(dtype).to(DEVICE)


def as_np(t):
    t = t.cpu()
    return t.to(torch.float64).numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.numpy()


def expect_reduce(dtype, shape, op, seed=0):
    xs = np.stack([as_np(data(r, dtype, shape, seed)).astype(np.float64) for r in range(N)])
    if op == hvd.Average:
        out = xs.sum(0) / N
        return np.trunc(out) if dtype in INTS else out
    return OPS[op](xs, axis=0)


def close(got, want, dtype, what):
    got = as_np(got).astype(np.float64)
    tol = {torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float32: 1e-6}.get(dtype, 1e-12)
    if not np.allclose(got, want, rtol=tol, atol=tol):
        raise AssertionError(f"{what} {dtype}: rank {R} got {got.ravel()[:6]}, want "
                             f"{np.ravel(want)[:6]}")


def ok(name):
    print(f"ok {name} rank {R}", flush=True)


def test_queries():
    assert hvd.is_initialized() and hvd.local_rank() == R and hvd.local_size() == N
    assert hvd.cross_rank() == 0 and hvd.cross_size() == 1 and hvd.is_homogeneous()
    assert hvd.mpi_enabled() and hvd.mpi_built() and not hvd.gloo_enabled()
    assert not hvd.gloo_built() and isinstance(hvd.nccl_built(), int)
    assert hvd.global_process_set.size() == N and hvd.global_process_set.rank() == R
    ok("queries")


def test_allreduce():
    for dtype in INTS + FLOATS:
        for op in OPS:
            shape = (3, 5)
            x = data(R, dtype, shape)
            if op == hvd.Average and dtype in INTS:
                continue  # integer averaging: see test_integer_average
            if op == hvd.Product and dtype in (torch.uint8, torch.int8):
                continue  # 3**4 wraps an 8-bit integer
            before = x.clone()
            y = hvd.allreduce(x, op=op, name=f"ar.{dtype}.{op}")
            assert y.dtype == dtype and y.shape == x.shape and torch.equal(x, before)
            close(y, expect_reduce(dtype, shape, op), dtype, f"allreduce op={op}")
            z = x.clone()
            hvd.allreduce_(z, op=op)
            close(z, expect_reduce(dtype, shape, op), dtype, f"allreduce_ op={op}")
    # bool: Sum/Max are logical or, Min/Product logical and
    b = data(R, torch.bool, (7,))
    allb = np.stack([data(r, torch.bool, (7,)).cpu().numpy() for r in range(N)])
    assert np.array_equal(hvd.allreduce(b, op=hvd.Max).cpu().numpy(), allb.any(0))
    assert np.array_equal(hvd.allreduce(b, op=hvd.Min).cpu().numpy(), allb.all(0))
    ok("allreduce")


def test_integer_average():
    same = torch.full((4,), 7 * (N + 1), dtype=torch.int32)  # identical on every rank
    assert torch.equal(hvd.allreduce(same), same)
    x = torch.tensor([R + 1, -(R + 1)], dtype=torch.int64)
    total = sum(range(1, N + 1))
    assert hvd.allreduce(x).tolist() == [int(total / N), -int(total / N)]  # toward zero
    ok("integer average")


def test_average_and_scaling():
    x = data(R, torch.float64, (4,))
    want = expect_reduce(torch.float64, (4,), hvd.Sum)
    close(hvd.allreduce(x, average=False), want, torch.float64, "average=False")
    close(hvd.allreduce(x), want / N, torch.float64, "default Average")
    y = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    close(y, want * 1.5, torch.float64, "pre/postscale")
    y = hvd.allreduce(x, op=hvd.Average, prescale_factor=2.0)
    close(y, want * 2 / N, torch.float64, "Average prescale")
    try:
        hvd.allreduce(x, average=True, op=hvd.Sum)
        raise AssertionError("average and op together must be a ValueError")
    except ValueError:
        pass
    try:
        hvd.allreduce(x, op=hvd.Adasum)
        raise AssertionError("Adasum must be refused")
    except NotImplementedError:
        pass
    c = hvd.allreduce(x, compression=hvd.Compression.fp16)
    assert c.dtype == torch.float64
    close(c, want / N, torch.float16, "fp16 compression")
    ok("average and scaling")


def test_async_and_grouped():
    xs = [data(R, torch.float32, (2, k), seed=k) for k in range(1, 5)]
    handles = [hvd.allreduce_async(x, op=hvd.Sum, name=f"async.{i}") for i, x in enumerate(xs)]
    for i, (x, h) in enumerate(zip(xs, handles)):
        out = hvd.synchronize(h)
        close(out, expect_reduce(torch.float32, (2, i + 1), hvd.Sum, seed=i + 1), torch.float32,
              "allreduce_async")
    h = hvd.allreduce_async_(xs[0], op=hvd.Sum)
    while not hvd.poll(h):
        pass
    res = hvd.synchronize(h)
    assert res is xs[0]
    close(xs[0], expect_reduce(torch.float32, (2, 1), hvd.Sum, seed=1), torch.float32, "poll")
    ys = [data(R, torch.float64, (k,), seed=k) for k in (3, 1, 6)]
    outs = hvd.grouped_allreduce(ys, op=hvd.Max, name="grp")
    for y, o, k in zip(ys, outs, (3, 1, 6)):
        close(o, expect_reduce(torch.float64, (k,), hvd.Max, seed=k), torch.float64, "grouped")
    h = hvd.grouped_allreduce_async_(ys, op=hvd.Sum)
    outs = hvd.synchronize(h)
    assert all(o is y for o, y in zip(outs, ys))
    zs = [torch.ones(2) * (R + 1) for _ in range(2)]
    assert all(torch.allclose(o, torch.full((2,), (N + 1) / 2)) for o in hvd.grouped_allreduce_(zs))
    ok("async and grouped")


def test_allgather():
    for dtype in INTS + FLOATS + [torch.bool]:
        rows = [r + 1 for r in range(N)]  # uneven first dimensions
        x = data(R, dtype, (rows[R], 3))
        y = hvd.allgather(x)
        want = np.concatenate([as_np(data(r, dtype, (rows[r], 3))) for r in range(N)])
        assert y.dtype == dtype and tuple(y.shape) == (sum(rows), 3), y.shape
        assert np.array_equal(as_np(y), want), dtype
    scalar = hvd.allgather(torch.tensor(float(R)))
    assert scalar.tolist() == [float(r) for r in range(N)]
    empty = hvd.allgather(torch.zeros((0 if R == 0 else 2, 4)))
    assert tuple(empty.shape) == (2 * (N - 1), 4)
    outs = hvd.grouped_allgather([torch.full((1,), R), torch.full((2, 2), R)])
    assert outs[0].tolist() == list(range(N)) and outs[1].shape == (2 * N, 2)
    h = hvd.allgather_async(torch.tensor([R]))
    assert hvd.synchronize(h).tolist() == list(range(N))
    ok("allgather")


def test_broadcast():
    for dtype in INTS + FLOATS + [torch.bool]:
        for root in range(N):
            x = data(R, dtype, (2, 3))
            y = hvd.broadcast(x, root_rank=root)
            assert torch.equal(y, data(root, dtype, (2, 3))) and torch.equal(x, data(R, dtype, (2, 3)))
            hvd.broadcast_(x, root)
            assert torch.equal(x, data(root, dtype, (2, 3)))
    h = hvd.broadcast_async(torch.tensor([R]), N - 1)
    assert hvd.synchronize(h).tolist() == [N - 1]
    try:
        hvd.broadcast(torch.zeros(1), root_rank=N)
        raise AssertionError("a root outside the set must be a ValueError")
    except ValueError:
        pass
    ok("broadcast")


def test_alltoall():
    for dtype in (torch.int32, torch.float16, torch.bfloat16, torch.float64):
        x = torch.stack([data(R, dtype, (2,), seed=d) for d in range(N) for _ in range(2)])
        y = hvd.alltoall(x)  # no splits: equal parts, one tensor back
        assert torch.is_tensor(y) and tuple(y.shape) == (2 * N, 2)
        want = torch.stack([data(s, dtype, (2,), seed=R) for s in range(N) for _ in range(2)])
        assert torch.equal(y, want), dtype
    # uneven splits: rank s sends (s + d) % 3 rows to rank d
    def rows_from(s, d):
        return (s + d) % 3
    splits = torch.tensor([rows_from(R, d) for d in range(N)], dtype=torch.int32)
    x = torch.cat([torch.full((rows_from(R, d), 2), 10 * R + d, dtype=torch.float32)
                   for d in range(N)] + [torch.zeros(1, 2)])  # one row left unsent
    out, received = hvd.alltoall(x, splits=splits)
    assert received.tolist() == [rows_from(s, R) for s in range(N)], received
    want = torch.cat([torch.full((rows_from(s, R), 2), 10 * s + R, dtype=torch.float32)
                      for s in range(N)])
    assert torch.equal(out, want)
    out2, rec2 = hvd.alltoall(x, splits=[rows_from(R, d) for d in range(N)])  # a list too
    assert torch.equal(out2, want) and torch.equal(rec2, received)
    for bad in ([1] * (N + 1), [100] * N):
        try:
            hvd.alltoall(x, splits=bad)
            raise AssertionError(f"splits {bad} must be a ValueError")
        except ValueError:
            pass
    if N > 1:
        try:
            hvd.alltoall(torch.zeros(N + 1, 2))
            raise AssertionError("an uneven first dimension without splits must be a ValueError")
        except ValueError:
            pass
    ok("alltoall")


def test_reducescatter():
    for dtype in (torch.int32, torch.int64, torch.float16, torch.float32, torch.float64):
        for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max):
            if op == hvd.Average and dtype in INTS:
                continue
            first = 2 * N + 1  # not divisible: the first rank gets one more row
            x = data(R, dtype, (first, 3))
            y = hvd.reducescatter(x, op=op)
            full = expect_reduce(dtype, (first, 3), op)
            mine = [first // N + (1 if r < first % N else 0) for r in range(N)]
            start = sum(mine[:R])
            assert y.dtype == dtype and tuple(y.shape) == (mine[R], 3), (y.shape, mine)
            close(y, full[start:start + mine[R]], dtype, f"reducescatter op={op}")
    x = data(R, torch.float64, (N * 2,))
    y = hvd.reducescatter(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    close(y, expect_reduce(torch.float64, (N * 2,), hvd.Sum)[2 * R:2 * R + 2] * 0.5,
          torch.float64, "reducescatter scaling")
    outs = hvd.grouped_reducescatter([x, x * 2], op=hvd.Sum)
    close(outs[1], 2 * expect_reduce(torch.float64, (N * 2,), hvd.Sum)[2 * R:2 * R + 2],
          torch.float64, "grouped reducescatter")
    ok("reducescatter")


def test_objects_and_barrier():
    obj = hvd.broadcast_object({"rank": R, "f": lambda v: v + 1}, root_rank=N - 1)
    assert obj["rank"] == N - 1 and obj["f"](1) == 2
    assert hvd.allgather_object(("r", R)) == [("r", r) for r in range(N)]
    hvd.barrier()
    ok("objects and barrier")


def test_process_sets():
    if N < 2:
        return
    evens = hvd.add_process_set([r for r in range(N) if r % 2 == 0])
    odds = hvd.add_process_set(hvd.ProcessSet([r for r in range(N) if r % 2 == 1]))
    mine, other = (evens, odds) if R % 2 == 0 else (odds, evens)
    assert mine.included() and not other.included() and other.rank() == -1
    assert mine.size() == len(mine.ranks) and mine.rank() == mine.ranks.index(R)
    x = torch.tensor([float(R)])
    assert hvd.allreduce(x, op=hvd.Sum, process_set=mine).item() == sum(mine.ranks)
    g = hvd.allgather(torch.tensor([R]), process_set=mine)
    assert g.tolist() == mine.ranks
    root = mine.ranks[-1]  # a global rank
    assert hvd.broadcast(x, root, process_set=mine).item() == root
    assert hvd.broadcast_object(R, root, process_set=mine) == root
    try:
        hvd.allreduce(x, process_set=other)
        raise AssertionError("a collective on a set this rank is not in must be a ValueError")
    except ValueError:
        pass
    try:
        hvd.add_process_set(mine.ranks)
        raise AssertionError("a duplicate process set must be a ValueError")
    except ValueError:
        pass
    hvd.barrier(process_set=mine)
    if N >= 4:  # an odd-sized set that leaves rank 0 out
        trio = hvd.add_process_set([1, 2, 3])
        if R in (1, 2, 3):
            assert trio.size() == 3 and trio.rank() == R - 1
            assert hvd.allreduce(x, op=hvd.Sum, process_set=trio).item() == 6
            assert hvd.allgather(torch.tensor([R] * R), process_set=trio).tolist() == [1, 2, 2, 3, 3, 3]
            got = hvd.reducescatter(torch.ones(5, 1) * R, op=hvd.Sum, process_set=trio)
            assert got.shape[0] == [2, 2, 1][R - 1] and torch.all(got == 6)
        assert hvd.remove_process_set(trio)
    assert hvd.remove_process_set(odds) and hvd.remove_process_set(evens)
    assert odds.process_set_id is None and not hvd.remove_process_set(hvd.global_process_set)
    ok("process sets")


def test_gradients():
    x = torch.arange(6, dtype=torch.float64).reshape(3, 2).requires_grad_()
    y = hvd.allreduce(x * (R + 1), op=hvd.Sum)
    y.backward(torch.ones_like(y))
    assert torch.allclose(x.grad, torch.full_like(x, (R + 1) * N)), x.grad  # Sum of ones, x(R+1)
    x.grad = None
    g = hvd.allgather(x)
    g.backward(torch.arange(g.numel(), dtype=torch.float64).reshape(g.shape))
    want = torch.arange(g.numel(), dtype=torch.float64).reshape(g.shape)[3 * R:3 * R + 3]
    assert torch.allclose(x.grad, want), x.grad  # averaged (identical) gradient, my rows
    x.grad = None
    b = hvd.broadcast(x, root_rank=0)
    b.backward(torch.ones_like(b) * (R + 1))
    assert torch.allclose(x.grad, torch.full_like(x, (N + 1) / 2 if R == 0 else 0.0)), x.grad
    x.grad = None
    a = torch.arange(2.0 * N, dtype=torch.float64).requires_grad_()
    out = hvd.alltoall(a)
    out.backward(torch.arange(2.0 * N, dtype=torch.float64) + 100 * R)
    # the gradient for the element sent to d comes back from d's slot for this rank
    want = torch.tensor([100 * d + 2 * R + k for d in range(N) for k in range(2)], dtype=torch.float64)
    assert torch.allclose(a.grad, want), a.grad
    s = torch.ones(2 * N, dtype=torch.float64).requires_grad_()
    rs = hvd.reducescatter(s, op=hvd.Sum)
    rs.backward(torch.full_like(rs, float(R + 1)))
    want = torch.cat([torch.full((2,), float((d + 1) * N)) for d in range(N)]).double()
    assert torch.allclose(s.grad, want), s.grad
    ok("gradients")


def test_join():
    if N < 2:
        assert hvd.join() == 0
        return
    # rank r has r + 1 batches; the others keep reducing with the joined ranks' zeros
    for step in range(R + 1):
        v = hvd.allreduce(torch.ones(3), op=hvd.Sum, name=f"join.{step}")
        assert torch.equal(v, torch.full((3,), float(N - step))), (step, v)
    last = hvd.join()
    assert last == N - 1, last
    # Horovod's rule: while rank 0 has joined, the others' allgather and broadcast raise
    # (on every rank, the joined one keeps serving), then they join too: nobody hangs
    if R == 0:
        assert hvd.join() == N - 1
    else:
        for call in (lambda: hvd.allgather(torch.ones(2)), lambda: hvd.broadcast(torch.ones(2), 1)):
            try:
                call()
                raise AssertionError("a collective other than allreduce ran beside a joined rank")
            except hvd.HorovodInternalError as exc:
                assert "joined" in str(exc), exc
        assert hvd.join() == N - 1
    ok("join")


for test in [test_queries, test_allreduce, test_integer_average, test_average_and_scaling,
             test_async_and_grouped, test_allgather, test_broadcast, test_alltoall,
             test_reducescatter, test_objects_and_barrier, test_process_sets, test_gradients,
             test_join]:
    if len(sys.argv) < 2 or test.__name__ in sys.argv[1:]:
        test()
hvd.shutdown()
assert not hvd.is_initialized()
