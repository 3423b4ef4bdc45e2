"""Resume at another rank count (issue 45): the data position is events, not steps, so a run
stopped mid-epoch on 2 ranks and resumed on 1, 3 or 4 trains every event of the epoch exactly
once (a counting model writes down every event it trains on)."""
import collections
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import (ENV, PMIX_START_FAILURE, REPO, TESTS, mpirun, mpirun_cmd, shared,
                      train_args)
from mpilearn.data.hdf5 import epoch_order, split_events
from mpilearn.data.position import remaining_batches, steps_left
from mpilearn.errors import UsageError
from mpilearn.train import checkpoint as ckpt
from mpilearn.train.resize import local_batch

EVENTS, VAL, BATCH = 1024, 0.1, 8  # toy_file's events; 922 train, a global batch of 16 at np=2


def args(toy_file, out, *extra):
    return train_args("--set", f"model={TESTS}/models/counting.py", "--set",
                      f"data.files=[{toy_file}]", "--set", "train.epochs=1",
                      "--set", f"train.batch_size={BATCH}", "--set", "hparams.sleep=0.04",
                      "--set", "train.lr_scaling=linear", "--output", out, *extra)


def trained(folder):
    """Every event trained, with how often, from the counting model's files."""
    counts = collections.Counter()
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            counts.update(int(i) for line in f for i in line.split())
    return counts


@pytest.fixture(scope="module")
def stopped(toy_file, tmp_path_factory):
    """An np=2 run stopped by SIGTERM to both ranks after 8 steps (shared by the resumes)."""
    def make(folder):
        for attempt in range(2):  # a launcher that failed to start (conftest.mpirun retries it)
            events = folder / "events"
            shutil.rmtree(events, ignore_errors=True)
            events.mkdir()
            job = subprocess.Popen(mpirun_cmd(2, args(toy_file, str(folder / "run"))), cwd=REPO,
                                   env={**ENV, "MPILEARN_TEST_EVENTS": str(events)},
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and job.poll() is None:
                if sum(trained(events).values()) >= 8 * 2 * BATCH:
                    break
                time.sleep(0.05)
            ranks = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True)
            for pid in map(int, ranks.stdout.split()):
                os.kill(pid, signal.SIGTERM)
            output, _ = job.communicate(timeout=120)
            if PMIX_START_FAILURE not in output:
                break
        assert job.returncode == 75, output

    return shared(tmp_path_factory, "resize-stopped-np2", make)


def order():
    """The epoch's global event order, as the loader makes it (seed 0, epoch 0)."""
    events = split_events(EVENTS, VAL, 0)[0]
    return events[epoch_order(len(events), 0, 0)]


@pytest.mark.parametrize("np_,policy", [(1, "rank"), (3, "rank"), (4, "global")])
def test_resume_at_another_size_trains_every_event_once(stopped, toy_file, tmp_path, np_, policy):
    out, events = tmp_path / "run", tmp_path / "events"
    shutil.copytree(stopped / "run", out)
    shutil.copytree(stopped / "events", events)
    state = ckpt.load(ckpt.latest(str(out / "checkpoints")))
    position = state["position"]
    assert state["epoch"] == 0 and 0 < position < 900 and state["world_size"] == 2
    assert sum(trained(events).values()) == position  # the stop came after a whole step
    sets = ["--set", f"train.elastic.batch={policy}", "--resume", "auto"]
    proc = mpirun(np_, args(toy_file, str(out), *sets),
                  env={"MPILEARN_TEST_EVENTS": str(events)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    per_rank = BATCH if policy == "rank" else 16 // np_
    g = per_rank * np_
    lines = [l for l in proc.stdout.splitlines() if "-> " in l and "ranks at" in l]
    assert len(lines) == 1, proc.stdout
    assert lines[0].startswith(f"mpilearn: 2 -> {np_} ranks at epoch 1, event {position} of 922: "
                               f"global batch 16 -> {g} ({per_rank} per rank, "
                               f"train.elastic.batch: {policy}); lr 0.02 -> ")
    # every event of the epoch once: the order up to the last whole global batch
    want = order()[:position + steps_left(922, position, g) * g]
    counts = trained(events)
    assert max(counts.values()) == 1
    assert sorted(counts) == sorted(want.tolist())
    if np_ == 1:  # float64: the weights are those of the same steps taken in one process
        final = ckpt.load(ckpt.latest(str(out / "checkpoints")))["task"]["models"]["model"]
        want_weights = replay(toy_file, [(16, 0.02, position // 16),
                                         (8, 0.01, (922 - position) // 8)])
        for k, v in want_weights.items():
            torch.testing.assert_close(final[k], v, rtol=0, atol=1e-12)


def replay(toy_file, phases):
    """The steps of an epoch in one process: (global batch, lr, steps) per phase, in the
    epoch's order; a global batch's mean gradient is what the ranks' allreduce averages."""
    import h5py
    from mpi4py import MPI

    import mpilearn
    from mpilearn.train.setup import new_task

    mpilearn.init()  # a world of one (tests/models/slow.py asks for the rank)
    config = {"model": f"{TESTS}/models/counting.py", "hparams": {"sleep": 0.0},
              "train": {"seed": 0, "deterministic": True, "precision": "fp32", "compile": "off",
                        "channels_last": "auto"}}
    task = new_task(config)
    task.setup(MPI.COMM_SELF, "cpu", "mpi", 0, distributed=False)
    with h5py.File(toy_file) as f:
        data = {k: f[k][:] for k in ("X", "y")}
    events, position = order(), 0
    for g, lr, steps in phases:
        for group in task.optimizer.param_groups:
            group["lr"] = lr
        for _ in range(steps):
            index = events[position:position + g]
            task.train_step(task.transform({k: v[index] for k, v in data.items()}))
            position += g
    return task.state_dict()["models"]["model"]


@pytest.mark.unit
def test_remaining_batches_cover_the_rest_once_at_any_size():
    order = np.random.default_rng(1).permutation(100)
    for size, batch in ((1, 4), (3, 2), (4, 5)):
        got = np.concatenate([b for r in range(size)
                              for b in remaining_batches(order, 30, r, size, batch)])
        whole = (100 - 30) // (size * batch) * size * batch
        assert sorted(got.tolist()) == sorted(order[30:30 + whole].tolist())


@pytest.mark.unit
def test_global_batch_policy_divides_or_names_the_values():
    train = {"batch_size": 8, "elastic": {"batch": "global"}}
    assert local_batch(train, 4, (16, 2)) == 4
    assert local_batch(train, 3, None) == 8  # a new run: the config's
    assert local_batch({**train, "elastic": {"batch": "rank"}}, 3, (16, 2)) == 8
    with pytest.raises(UsageError, match="global batch of 16 events .written by 2 ranks., which 3 "
                                         "ranks cannot share evenly; run on 1, 2, 4, 8 ranks"):
        local_batch(train, 3, (16, 2))


def test_relaunch_after_a_crash_trains_every_event_once(toy_file, tmp_path):
    """mpilearn-run's relaunch mode under MPICH's Hydra mpiexec (no ULFM: the mode is chosen
    from the launcher): rank 1 crashes right after the step-8 checkpoint, the job runs again
    from it, and every event of the epoch is trained once."""
    mpich = os.path.join(REPO, ".venv", "mpich")
    if not os.path.exists(os.path.join(mpich, "bin", "mpirun")):
        pytest.fail(f"{mpich}/bin/mpirun missing: `make test` installs MPICH's Hydra")
    events = tmp_path / "events"
    events.mkdir()
    cmd = ["-np", "2", "--min-np", "1", sys.executable,
           *args(toy_file, str(tmp_path / "run"), "--set", "train.checkpoint_every_steps=4")]
    env = {**ENV, "PATH": f"{mpich}/bin:{ENV['PATH']}", "LD_LIBRARY_PATH": f"{mpich}/lib",
           "MPI4PY_MPIABI": "mpich", "MPILEARN_TEST_CRASH_AT": "9",
           "MPILEARN_TEST_EVENTS": str(events)}
    env.pop("MPILEARN_ELASTIC_MODE", None)
    proc = subprocess.run([sys.executable, "-m", "mpilearn.run", *cmd], cwd=REPO, text=True,
                          capture_output=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "mpilearn-run: mpirun -n 2 -genvall" in proc.stderr  # Hydra's
    assert "deliberate crash before step 9" in proc.stderr
    assert proc.stderr.count("relaunching from the newest checkpoint (restart 1 of 3)") == 1
    assert "resumed from" in proc.stdout and "ckpt-e0000-s0000008.pt" in proc.stdout
    counts = trained(events)
    assert max(counts.values()) == 1
    assert sorted(counts) == sorted(order()[:922 // 16 * 16].tolist())


@pytest.mark.unit
def test_the_elastic_section_is_checked_and_takes_the_launchers_bounds(monkeypatch):
    from mpilearn.core.config import resolve

    with pytest.raises(UsageError, match="did you mean 'train.elastic.min_ranks'"):
        resolve(None, ["model=m.py", "train.elastic.min_rank=2"])
    with pytest.raises(UsageError, match=r"'train.elastic.max_ranks' \(2\) is below"):
        resolve(None, ["model=m.py", "train.elastic.min_ranks=3", "train.elastic.max_ranks=2"])
    with pytest.raises(UsageError, match="choose one of rank, global"):
        resolve(None, ["model=m.py", "train.elastic.batch=globl"])
    monkeypatch.setenv("MPILEARN_ELASTIC_MIN_RANKS", "2")  # mpilearn-run --min-np 2
    assert resolve(None, ["model=m.py"])["train"]["elastic"]["min_ranks"] == 2
    own = resolve(None, ["model=m.py", "train.elastic.min_ranks=3"])
    assert own["train"]["elastic"]["min_ranks"] == 3
