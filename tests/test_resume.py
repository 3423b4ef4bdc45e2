"""kill -9 or a stop signal mid-epoch, resume, and the final weights equal an uninterrupted
run's."""
import json
import os
import signal
import subprocess
import time

import pytest
import torch

from conftest import (ENV, REPO, TESTS, kill9_after_mid_epoch_checkpoint, mpirun, mpirun_cmd, shared,
                      train_args)
from mpilearn.train import checkpoint as ckpt


def args(toy_file, out):
    return train_args("--set", f"model={TESTS}/models/slow.py", "--set", f"data.files=[{toy_file}]",
                      "--set", "train.epochs=3", "--set", "train.batch_size=16",
                      "--set", "train.checkpoint_every_steps=4", "--set", "train.deterministic=true",
                      "--set", "hparams.sleep=0.04", "--output", out)


def epoch_losses(out):
    """Every epoch's losses as logged (float64 from the JSON)."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [(r["epoch"], r["train_loss"], r["val_loss"]) for r in records if "time" in r]


def final_weights(out):
    state = ckpt.load(ckpt.latest(os.path.join(out, "checkpoints")))
    assert state["epoch"] == 3 and state["step_in_epoch"] == 0
    return state["task"]["models"]["model"]


@pytest.fixture(scope="session")
def whole(toy_file, tmp_path_factory):
    """The uninterrupted run every interrupted run must reproduce (here and in
    test_stop_signals; trained once per session, shared read-only)."""
    def train(folder):
        proc = mpirun(2, args(toy_file, str(folder / "run")))
        assert proc.returncode == 0, proc.stderr

    return str(shared(tmp_path_factory, "slow-mlp-whole", train) / "run")


def test_kill9_then_resume_matches_uninterrupted(toy_file, tmp_path, whole):

    cut = str(tmp_path / "cut")
    kill9_after_mid_epoch_checkpoint(2, args(toy_file, cut), cut)
    killed_at = ckpt.load(ckpt.latest(os.path.join(cut, "checkpoints")))
    assert killed_at["epoch"] < 3, "the run finished before it was killed"

    proc = mpirun(2, args(toy_file, cut) + ["--resume"])
    assert proc.returncode == 0, proc.stderr
    assert "resumed from" in proc.stdout
    got, want = final_weights(cut), final_weights(whole)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    # the metrics of the killed epochs were kept and the resumed ones appended
    lines = open(os.path.join(cut, "metrics.jsonl")).read().splitlines()
    assert [json.loads(l)["epoch"] for l in lines] == [1, 2, 3]
    # the interrupted epoch's training loss too: every rank's running sums were checkpointed
    assert epoch_losses(cut) == epoch_losses(whole)
    # the killed holder's lock was taken over, with one line naming it
    assert proc.stdout.count("mpilearn: took over the lock ") == 1, proc.stdout
    assert "is gone" in proc.stdout and not os.path.exists(os.path.join(cut, ".mpilearn.lock"))


def test_stop_signal_checkpoints_exits_75_and_resume_auto_matches(toy_file, tmp_path, whole):
    out = str(tmp_path / "signalled")
    fresh = mpirun(1, args(toy_file, str(tmp_path / "strict")) + ["--resume"])
    assert fresh.returncode == 2 and "no checkpoint in" in fresh.stderr  # strict --resume
    job = subprocess.Popen(mpirun_cmd(2, args(toy_file, out) + ["--resume", "auto"]), cwd=REPO,
                           env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not os.path.exists(metrics):
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)  # mpirun forwards SIGUSR1 to every rank
    stdout, stderr = job.communicate(timeout=120)
    assert job.returncode == 75, stderr
    assert stdout.count("mpilearn: stopped by SIGUSR1; checkpoint ") == 1, stdout
    stopped = ckpt.load(ckpt.latest(os.path.join(out, "checkpoints")))
    assert stopped["epoch"] < 3 and stopped["step_in_epoch"] > 0  # mid-epoch, not an epoch end

    proc = mpirun(2, args(toy_file, out) + ["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr
    got, want = final_weights(out), final_weights(whole)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    assert epoch_losses(out) == epoch_losses(whole)  # the stopped epoch's train_loss too
    again = mpirun(2, args(toy_file, out) + ["--resume", "auto"])  # a finished run stays finished
    assert again.returncode == 0 and "done after 3 epoch(s)" in again.stdout
