"""The MLP example for bench/elastic.py: ``MPILEARN_BENCH_KILL=R:S`` makes world rank R kill
itself with SIGKILL as it starts its step S+1, after writing the time to
``MPILEARN_BENCH_KILL_STAMP`` (the start of the recovery time)."""
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "models"))
import mlp  # noqa: E402

DEFAULTS = mlp.DEFAULTS


def build(hparams):
    from mpi4py import MPI

    task = mlp.build(hparams)
    plain_step = task.train_step
    kill = os.environ.get("MPILEARN_BENCH_KILL")
    victim, at = (int(x) for x in kill.split(":")) if kill else (-1, -1)
    steps = [0]

    def train_step(batch):
        if steps[0] == at and MPI.COMM_WORLD.Get_rank() == victim:
            with open(os.environ["MPILEARN_BENCH_KILL_STAMP"], "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        steps[0] += 1
        return plain_step(batch)

    task.train_step = train_step
    return task
