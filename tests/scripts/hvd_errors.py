"""Collectives whose ranks disagree must raise on every rank that took part, within seconds,
and leave the library usable. Prints "ok NAME seconds" per case."""
import time

import torch

import mpilearn.torch as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()


def raises_everywhere(name, fn, exc=hvd.HorovodInternalError, needle=""):
    start = time.monotonic()
    try:
        fn()
    except exc as e:
        assert needle in str(e), f"{name}: {e}"
    else:
        raise AssertionError(f"{name}: no {exc.__name__} on rank {R}")
    seconds = time.monotonic() - start
    assert seconds < 10, f"{name} took {seconds:.1f} s"
    # the next collective works: the ranks are still in step
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == N
    print(f"ok {name} {seconds:.3f}", flush=True)


raises_everywhere("shape", lambda: hvd.allreduce(torch.zeros(17 + R, 3)), needle="shape")
raises_everywhere("rank of tensor", lambda: hvd.allreduce(torch.zeros([2] * (1 + R % 2))),
                  needle="shape")
raises_everywhere("dtype", lambda: hvd.allreduce(torch.zeros(3, dtype=[torch.float32, torch.int32][R % 2])),
                  needle="data types")
raises_everywhere("op", lambda: hvd.allreduce(torch.zeros(3), op=[hvd.Sum, hvd.Max][R % 2]),
                  needle="reduction operation")
raises_everywhere("scale", lambda: hvd.allreduce(torch.zeros(3), prescale_factor=1.0 + R % 2),
                  needle="prescale")
raises_everywhere("allgather trailing dims",
                  lambda: hvd.allgather(torch.zeros(2, 3 + R % 2)), needle="dimension")
raises_everywhere("broadcast root", lambda: hvd.broadcast(torch.zeros(2), root_rank=R % 2),
                  needle="root")
raises_everywhere("broadcast shape", lambda: hvd.broadcast(torch.zeros(2 + R), 0), needle="shape")
raises_everywhere("kind", lambda: hvd.allreduce(torch.zeros(2)) if R % 2 else
                  hvd.allgather(torch.zeros(2)), needle="operations")
raises_everywhere("name", lambda: hvd.allreduce(torch.zeros(2), name=f"n{R % 2}"), needle="names")
raises_everywhere("reducescatter shape", lambda: hvd.reducescatter(torch.zeros(4 + R, 2)),
                  needle="shape")
raises_everywhere("alltoall trailing dims",
                  lambda: hvd.alltoall(torch.zeros(N, 1 + R % 2)), needle="dimension")
raises_everywhere("grouped", lambda: hvd.grouped_allreduce([torch.zeros(2), torch.zeros(2 + R)]),
                  needle="shape")

# a duplicate pending name is a ValueError on the rank that submits it, at once (Horovod's
# own test: rank 0 submits while the others still wait in a barrier)
tensor = torch.zeros(17, 17, 17)


def submit_then_duplicates(tries):
    hvd.allreduce_async(tensor, name="duplicate_name")
    for _ in range(tries):
        try:
            hvd.allreduce_async(tensor, name="duplicate_name")
            raise AssertionError("no ValueError for a duplicate name")
        except ValueError:
            pass


if R == 0:
    submit_then_duplicates(10)
hvd.barrier()
if R > 0:
    submit_then_duplicates(1)
hvd.barrier()
assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == N
print("ok duplicate name", flush=True)

# local argument errors are ValueErrors before anything is sent
for bad in (lambda: hvd.allreduce(torch.zeros(2), average=True, op=hvd.Sum),
            lambda: hvd.broadcast(torch.zeros(2), root_rank=N + 5),
            lambda: hvd.alltoall(torch.zeros(N), splits=[1] * (N + 1))):
    try:
        bad()
        raise AssertionError("no ValueError")
    except ValueError:
        pass
assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == N
print("ok local errors", flush=True)
