"""The float64 MLP that counts every event it trains on (a buffer summed over the ranks, so it
is in the weights and compared with them), for elastic and resume tests.

``MPILEARN_TEST_KILL=R:S``: world rank R (or each of R1,R2,...: a node's ranks; ``spawned``: a
rank that joined by an in-process growth, which first puts the discovery script's answer back to
``localhost:2`` so that the job does not grow again) kills itself with SIGKILL as it starts its
step S+1 (after S applied steps, its own); ``MPILEARN_TEST_STOP=S``: every
rank sends itself SIGTERM after its step S, so the run stops at exactly that step (the replay of
an elastic run);
``MPILEARN_TEST_KILL_AT_START=R[:FILE]``: world rank R kills itself as it builds the model
(start-up, before the weights' broadcast and the first snapshot); with FILE, only if FILE does
not exist yet (it creates it: a relaunch starts whole);
``MPILEARN_TEST_KILL_IN_RECOVERY=R``: world rank R kills itself in the survivors' recovery of a
loss, as its task is rebound to the shrunk communicator (before the agreement on the step);
``MPILEARN_TEST_STEP_LOG=DIR``: each rank appends the time of each of its steps to DIR/rankR;
``MPILEARN_TEST_SLOW=R:S:SECONDS``: world rank R's steps from its step S on take SECONDS more.
``MPILEARN_TEST_GROW=S:FILE:TEXT``: after step S, world rank 0 writes TEXT (a discovery
script's answer) to FILE, if it holds anything else, and waits for the stop signal that
mpilearn-run sends when it sees the new hosts: the growth lands on step S.
``MPILEARN_TEST_HANG_SPAWNED=1``: a rank that joined by a growth hangs as it builds the model
(after the merge, before it joins the job's step). Environment, not
hparams: the runs compared keep one config."""
import faulthandler
import os
import signal
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import slow64  # noqa: E402

DEFAULTS = {**slow64.DEFAULTS, "sleep": 0.0, "events": 1024}


def _env_steps(name):
    value = os.environ.get(name, "")
    return tuple(int(x) for x in value.split(":")) if value else None


def arm(task):
    """MPILEARN_TEST_KILL and MPILEARN_TEST_STOP on ``task``'s steps (any task)."""
    from mpilearn.core import comm as mcomm, membership

    plain_step = task.train_step
    victims, _, kill_step = os.environ.get("MPILEARN_TEST_KILL", "").partition(":")
    kill = (victims.split(","), int(kill_step)) if kill_step else None
    grow = os.environ.get("MPILEARN_TEST_GROW", "").split(":", 2)

    def victim():
        if "spawned" in kill[0] and membership.spawned():
            _offer(grow[1], "localhost:2")
            return True
        return str(mcomm.mpi().COMM_WORLD.Get_rank()) in kill[0]

    stop = _env_steps("MPILEARN_TEST_STOP")
    steps = [0]
    world_rank = mcomm.mpi().COMM_WORLD.Get_rank()
    at_start, _, once = os.environ.get("MPILEARN_TEST_KILL_AT_START", "").partition(":")
    if str(world_rank) in at_start.split(",") and not (once and os.path.exists(once)):
        if once:  # the relaunch starts whole
            open(once, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("MPILEARN_TEST_HANG_SPAWNED") == "1" and membership.spawned():
        time.sleep(3600)
    if str(world_rank) in os.environ.get("MPILEARN_TEST_KILL_IN_RECOVERY", "").split(","):
        plain_rebind = task.rebind

        def rebind(comm):
            os.kill(os.getpid(), signal.SIGKILL)
            plain_rebind(comm)

        task.rebind = rebind

    step_log = os.environ.get("MPILEARN_TEST_STEP_LOG")  # a folder: each rank's step times
    slow_rank, slow_from, slow_s = (os.environ.get("MPILEARN_TEST_SLOW") or "-1:0:0").split(":")

    def train_step(batch):
        if kill and steps[0] == kill[1] and victim():
            os.kill(os.getpid(), signal.SIGKILL)
        losses = plain_step(batch)
        steps[0] += 1
        if world_rank == int(slow_rank) and steps[0] >= int(slow_from):
            time.sleep(float(slow_s))
        if step_log:
            with open(os.path.join(step_log, f"rank{world_rank}"), "a") as f:
                f.write(f"{time.time()}\n")
        if stop and steps[0] == stop[0]:
            os.kill(os.getpid(), signal.SIGTERM)
        if len(grow) == 3 and steps[0] == int(grow[0]) \
                and mcomm.mpi().COMM_WORLD.Get_rank() == 0 and _offer(grow[1], grow[2]):
            from mpilearn.cluster import preempt

            deadline = time.monotonic() + 60
            while preempt.requested() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        return losses

    task.train_step = train_step
    return task


def _offer(path, text):
    """Writes the discovery script's new answer; False if it was given already (a relaunch)."""
    with open(path) as f:
        if f.read().strip() == text:
            return False
    with open(path, "w") as f:
        f.write(text + "\n")
    return True


def build(hparams):
    from mpilearn.core import comm as mcomm

    # where a hung rank waits (kill -USR2); SIGUSR1 is the stop signal mpilearn-run forwards
    faulthandler.register(signal.SIGUSR2, all_threads=True)

    hp = {**DEFAULTS, **hparams}
    task = slow64.build({k: v for k, v in hp.items() if k != "events"})
    task.model.register_buffer("seen", torch.zeros(int(hp["events"]), dtype=torch.float64))
    plain_step = task.train_step

    def train_step(batch):
        MPI = mcomm.mpi()
        losses = plain_step(batch)
        counts = np.zeros(len(task.model.seen))
        np.add.at(counts, np.asarray(batch["_index"]), 1.0)
        mcomm.context().comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)  # the live ranks
        task.model.seen += torch.from_numpy(counts)
        return losses

    task.train_step = train_step
    return arm(task)
