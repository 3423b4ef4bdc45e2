"""kill -9 mid-epoch, --resume, and the final weights equal an uninterrupted run's."""
import json
import os
import signal
import subprocess
import time

import torch

from conftest import ENV, REPO, TESTS, mpirun, mpirun_cmd, train_args
from mpilearn.train import checkpoint as ckpt


def args(toy_file, out):
    return train_args("--set", f"model={TESTS}/models/slow.py", "--set", f"data.files=[{toy_file}]",
                      "--set", "train.epochs=3", "--set", "train.batch_size=16",
                      "--set", "train.checkpoint_every_steps=4", "--set", "train.deterministic=true",
                      "--set", "hparams.sleep=0.04", "--output", out)


def final_weights(out):
    state = ckpt.load(ckpt.latest(os.path.join(out, "checkpoints")))
    assert state["epoch"] == 3 and state["step_in_epoch"] == 0
    return state["task"]["models"]["model"]


def test_kill9_then_resume_matches_uninterrupted(toy_file, tmp_path):
    whole = str(tmp_path / "whole")
    proc = mpirun(2, args(toy_file, whole))
    assert proc.returncode == 0, proc.stderr

    cut = str(tmp_path / "cut")
    job = subprocess.Popen(mpirun_cmd(2, args(toy_file, cut)), cwd=REPO, env=ENV,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    pointer = os.path.join(cut, "checkpoints", "latest")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if os.path.exists(pointer) and open(pointer).read().startswith("ckpt-e0001-s00000"):
            name = open(pointer).read().strip()
            if not name.endswith("s0000000.pt"):
                break  # a mid-epoch checkpoint of the second epoch exists
        time.sleep(0.05)
    else:
        job.kill()
        raise AssertionError("no mid-epoch checkpoint appeared")
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
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
