"""mpilearn.tensorflow under mpirun (1-4 ranks): every collective against a numpy reference,
eagerly and inside tf.function, their gradients, DistributedGradientTape (dense, IndexedSlices,
sparse_as_dense, groups, predivide, fp16), broadcast_variables, the objects, process sets and
a mismatch that raises on every rank. Each rank builds every rank's input from its rank, so
it knows the expected result without communicating. Prints "ok NAME rank R"."""
import numpy as np
import tensorflow as tf

import mpilearn.tensorflow as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()
INTS = [tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64]
FLOATS = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
NP_OPS = {hvd.Sum: np.sum, hvd.Min: np.min, hvd.Max: np.max, hvd.Product: np.prod}
MODES = {"eager": lambda f: f, "graph": tf.function}


def data(rank, dtype, shape, seed=0):
    g = np.random.default_rng(1000 * seed + rank)
    lo = 0 if dtype in (tf.uint8, tf.uint16) else -3
    return tf.cast(tf.constant(g.integers(lo, 4, shape)), dtype)


def everyone(dtype, shape, seed=0):
    return np.stack([data(r, dtype, shape, seed).numpy().astype(np.float64) for r in range(N)])


def close(got, want, what, tol=1e-6):
    got = tf.cast(got, tf.float64).numpy()
    if got.shape != np.shape(want) or not np.allclose(got, want, rtol=tol, atol=tol):
        raise AssertionError(f"{what}: rank {R} got {got.ravel()[:6]} {got.shape}, want "
                             f"{np.ravel(want)[:6]} {np.shape(want)}")


def ok(name):
    print(f"ok {name} rank {R}", flush=True)


def test_queries():
    assert hvd.is_initialized() and hvd.local_rank() == R and hvd.local_size() == N
    assert hvd.cross_rank() == 0 and hvd.cross_size() == 1 and hvd.is_homogeneous()
    assert hvd.mpi_enabled() and hvd.mpi_built() and not hvd.gloo_enabled()
    assert int(hvd.size_op()) == N and int(hvd.rank_op()) == R
    ok("queries")


def test_allreduce(mode, wrap):
    for dtype in [tf.int32, tf.int64] + FLOATS:
        for op in [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]:
            if op == hvd.Average and not dtype.is_floating:
                continue
            f = wrap(lambda x: hvd.allreduce(x, op=op))
            want = (everyone(dtype, (3, 4)).mean(0) if op == hvd.Average
                    else NP_OPS[op](everyone(dtype, (3, 4)), axis=0))
            y = f(data(R, dtype, (3, 4)))
            assert y.dtype == dtype
            close(y, want, f"{mode} allreduce {dtype.name} op {op}", 1e-2)
    g = wrap(lambda x: hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0))
    close(g(data(R, tf.float64, (5,))), 1.5 * everyone(tf.float64, (5,)).sum(0), "scaled")
    fp16 = wrap(lambda x: hvd.allreduce(x, compression=hvd.Compression.fp16))
    y = fp16(data(R, tf.float32, (5,)))
    assert y.dtype == tf.float32
    close(y, everyone(tf.float32, (5,)).mean(0), "fp16 compression", 1e-3)
    grouped = wrap(lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Sum))
    a, b = grouped(data(R, tf.float32, (2, 3)), data(R, tf.float64, (4,), 1))
    close(a, everyone(tf.float32, (2, 3)).sum(0), "grouped a")
    close(b, everyone(tf.float64, (4,), 1).sum(0), "grouped b")
    try:
        hvd.allreduce(tf.ones(2), op=hvd.Adasum)
        raise AssertionError("Adasum did not raise")
    except NotImplementedError:
        pass
    ok(f"allreduce {mode}")


def test_gather_family(mode, wrap):
    for dtype in INTS + FLOATS + [tf.bool]:
        rows = lambda r: r + 1  # noqa: E731  ranks send different first dimensions
        x = tf.cast(data(R, tf.int32, (rows(R), 2)), dtype)
        want = np.concatenate([tf.cast(data(r, tf.int32, (rows(r), 2)), dtype).numpy()
                               .astype(np.float64) for r in range(N)])
        y = wrap(lambda t: hvd.allgather(t))(x)
        assert y.dtype == dtype
        close(y, want, f"{mode} allgather {dtype.name}")
        root = N - 1
        y = wrap(lambda t: hvd.broadcast(t, root))(x[:1])
        close(y, tf.cast(data(root, tf.int32, (1, 2)), dtype).numpy().astype(np.float64),
              f"{mode} broadcast {dtype.name}")
    a, b = wrap(lambda p, q: hvd.grouped_allgather([p, q]))(data(R, tf.float32, (2,)),
                                                             data(R, tf.int64, (1, 3)))
    close(a, everyone(tf.float32, (2,)).reshape(-1), "grouped allgather")
    close(b, everyone(tf.int64, (1, 3)).reshape(-1, 3), "grouped allgather 2")
    # alltoall: rank r sends (d + 1) rows to rank d, rows valued 100 r + d
    splits = tf.constant([d + 1 for d in range(N)], tf.int32)
    x = tf.concat([tf.fill([d + 1, 2], 100.0 * R + d) for d in range(N)], 0)
    out, received = wrap(lambda t, s: hvd.alltoall(t, splits=s))(x, splits)
    close(received, [R + 1] * N, "alltoall splits")
    close(out, np.concatenate([np.full((R + 1, 2), 100.0 * r + R) for r in range(N)]),
          f"{mode} alltoall")
    even = wrap(lambda t: hvd.alltoall(t))(tf.fill([2 * N], float(R)))
    close(even, np.repeat(np.arange(N, dtype=np.float64), 2), "alltoall even")
    rows = 2 * N + 1
    for op in (hvd.Sum, hvd.Average, hvd.Max):
        y = wrap(lambda t: hvd.reducescatter(t, op=op))(data(R, tf.float32, (rows, 2)))
        full = everyone(tf.float32, (rows, 2))
        full = full.mean(0) if op == hvd.Average else NP_OPS[op](full, axis=0)
        start = sum(rows // N + (r < rows % N) for r in range(R))
        close(y, full[start:start + rows // N + (R < rows % N)], f"{mode} reducescatter {op}")
    ok(f"gather family {mode}")


def test_gradients(mode, wrap):
    def grads(x):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            outs = [hvd.allreduce(x, op=hvd.Sum), hvd.allgather(x), hvd.broadcast(x, 0),
                    hvd.reducescatter(tf.tile(x, [N, 1]), op=hvd.Sum)]
            losses = [tf.reduce_sum(o * (hvd.rank() + 1.0)) for o in outs]
        return [tape.gradient(loss, x) for loss in losses]

    x = tf.ones((2, 3))
    g_sum, g_gather, g_bcast, g_rs = wrap(grads)(x)
    ranks_sum = sum(r + 1.0 for r in range(N))
    close(g_sum, np.full((2, 3), ranks_sum), f"{mode} allreduce grad")
    close(g_gather, np.full((2, 3), ranks_sum / N), f"{mode} allgather grad")
    close(g_bcast, np.full((2, 3), ranks_sum / N if R == 0 else 0.0), f"{mode} broadcast grad")
    # Horovod's reducescatter gradient for Sum: the gathered gradient times the set size
    close(g_rs, np.full((2, 3), N * ranks_sum), f"{mode} reducescatter grad")
    ok(f"gradients {mode}")


def test_tape(mode, wrap):
    dense = tf.Variable(tf.ones((3, 2)))
    table = tf.Variable(tf.ones((5, 2)))

    def step(x, **kw):
        with tf.GradientTape() as tape:
            rows = tf.gather(table, [R % 5, 4])
            loss = tf.reduce_sum(dense * x) + tf.reduce_sum(rows * x[0])
        tape = hvd.DistributedGradientTape(tape, **kw)
        return tape.gradient(loss, [dense, table])

    x = tf.fill((3, 2), float(R + 1))
    mean_x = np.mean([r + 1.0 for r in range(N)])
    table_want = np.zeros((5, 2))
    for r in range(N):
        table_want[[r % 5, 4]] += (r + 1.0) / N
    for kw in [{}, {"sparse_as_dense": True}, {"num_groups": 2},
               {"gradient_predivide_factor": 2.0, "sparse_as_dense": True},
               {"compression": hvd.Compression.fp16},
               {"groups": [[dense]]}]:
        gd, gt = wrap(lambda v: step(v, **kw))(x)
        close(gd, np.full((3, 2), mean_x), f"{mode} tape dense {kw}", 1e-3)
        assert isinstance(gt, tf.IndexedSlices) != bool(kw.get("sparse_as_dense")), kw
        close(tf.convert_to_tensor(gt), table_want, f"{mode} tape sparse {kw}", 1e-3)
    gd, _ = wrap(lambda v: step(v, op=hvd.Sum))(x)
    close(gd, np.full((3, 2), mean_x * N), f"{mode} tape Sum")
    ok(f"tape {mode}")


def test_broadcast_variables_and_objects():
    v = [tf.Variable(tf.fill((2, 2), float(R))), tf.Variable(tf.constant(R, tf.int64))]
    hvd.broadcast_variables(v, root_rank=N - 1)
    close(v[0], np.full((2, 2), N - 1.0), "broadcast_variables")
    close(v[1], N - 1, "broadcast_variables int")
    w = tf.Variable(tf.fill((3,), float(R)))
    tf.function(lambda: hvd.broadcast_variables([w], 0))()
    close(w, np.zeros(3), "broadcast_variables in tf.function")
    # DistributedOptimizer for loops that call apply_gradients: the mean gradient is applied
    var = tf.Variable(tf.ones(3))
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.5))
    opt.apply_gradients([(tf.fill((3,), float(R + 1)), var)])
    close(var, np.full(3, 1 - 0.5 * np.mean([r + 1.0 for r in range(N)])), "DistributedOptimizer")
    assert hvd.broadcast_object({"r": R}, root_rank=0) == {"r": 0}
    assert hvd.allgather_object(R) == list(range(N))
    ok("broadcast variables")


def test_process_set_and_mismatch():
    if N >= 2:
        members = list(range(1, N))
        ps = hvd.add_process_set(members)
        if R in members:
            got = hvd.allreduce(tf.constant([float(R)]), op=hvd.Sum, process_set=ps)
            close(got, [float(sum(members))], "process set allreduce")
        assert hvd.remove_process_set(ps)
        try:  # shapes differ on rank 0: every rank raises (no hang)
            hvd.allreduce(tf.ones((2 if R == 0 else 3,)))
            raise AssertionError("mismatch did not raise")
        except hvd.HorovodInternalError as exc:
            assert "Mismatched" in str(exc), exc
        try:
            tf.function(lambda: hvd.allreduce(tf.ones((2 if R == 0 else 3,))))()
            raise AssertionError("mismatch in a graph did not raise")
        except Exception as exc:  # the graph wraps it in an InvalidArgumentError/UnknownError
            assert "Mismatched" in str(exc), exc
    hvd.barrier()
    ok("process sets and mismatch")


test_queries()
for mode, wrap in MODES.items():
    test_allreduce(mode, wrap)
    test_gather_family(mode, wrap)
    test_gradients(mode, wrap)
    test_tape(mode, wrap)
test_broadcast_variables_and_objects()
test_process_set_and_mismatch()
print(f"done rank {R}", flush=True)
