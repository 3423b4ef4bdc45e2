"""Elastic training under real ``mpirun --with-ft ulfm`` and a real ``kill -9``: the survivors
finish on fewer ranks, every event is trained once per epoch, and the weights equal the replay
(stop at the agreed step at np=3, resume at np=2)."""
import json
import os
import subprocess
import sys

import pytest
import torch

import horovod_examples
from conftest import ENV, REPO, TESTS, mpirun, shared, train_args
from mpilearn.train import checkpoint as ckpt

KILL_AFTER = 20  # applied steps before the victim dies (even: the rest fills np=2's batches)


def args(toy_file, out, *extra):
    # 960 training events: 80 global batches of 12 at np=3, 120 of 8 at np=2
    return train_args("--set", f"model={TESTS}/models/elastic_mlp.py", "--set",
                      f"data.files=[{toy_file}]", "--set", "data.val_fraction=0.0625",
                      "--set", "train.epochs=2", "--set", "train.batch_size=4",
                      "--set", "train.deterministic=true", "--output", out, *extra)


def ulfm_run(np_, argv, env):
    return subprocess.run(["mpirun", "--with-ft", "ulfm", "-np", str(np_), "--oversubscribe",
                           *[a for k in env for a in ("-x", k)], sys.executable, *argv],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**ENV, **env})


def final_model(out):
    return ckpt.load(ckpt.latest(os.path.join(out, "checkpoints")))["task"]["models"]["model"]


def assert_same(got, want):
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


@pytest.fixture(scope="session")
def replay(toy_file, tmp_path_factory):
    """Stopped by a signal after exactly KILL_AFTER steps at np=3, resumed at np=2."""
    def train(folder):
        out = str(folder / "run")
        stop = mpirun(3, args(toy_file, out), env={"MPILEARN_TEST_STOP": str(KILL_AFTER)})
        assert stop.returncode == 75, stop.stderr
        proc = mpirun(2, args(toy_file, out, "--resume"))
        assert proc.returncode == 0, proc.stderr

    return str(shared(tmp_path_factory, "elastic-replay", train) / "run")


@pytest.mark.parametrize("victim", [1, 0])
def test_kill9_mid_epoch_survivors_finish_equal_to_replay(toy_file, tmp_path, replay, victim):
    out = str(tmp_path / "run")
    proc = ulfm_run(3, args(toy_file, out, "--set", "train.elastic.min_ranks=2"),
                    {"MPILEARN_TEST_KILL": f"{victim}:{KILL_AFTER}"})
    assert proc.returncode == 0, proc.stderr
    line = (f"mpilearn: lost rank {victim} on ")
    assert proc.stdout.count(line) == 1, proc.stdout
    assert (f"at step {KILL_AFTER + 1} (epoch 1); going on with 2 rank(s) from step {KILL_AFTER}, "
            "global batch 8, lr 0.01") in proc.stdout
    assert ("rank 0's duties moved here" in proc.stdout) == (victim == 0)
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    change = [r for r in records if "membership" in r]
    assert len(change) == 1 and change[0]["membership"]["lost_ranks"] == [victim]
    assert change[0]["step"] == KILL_AFTER and change[0]["position"] == 12 * KILL_AFTER
    assert [r["epoch"] for r in records if "time" in r] == [1, 2]
    model = final_model(out)
    # every training event twice in two epochs (the held-out 64 never)
    assert sorted(model["seen"].unique().tolist()) == [0.0, 2.0]
    assert int((model["seen"] == 2).sum()) == 960
    assert_same(model, final_model(replay))
    # the lock went with the writer (the lost rank 0's taken over, then released)
    assert not os.path.exists(os.path.join(out, ".mpilearn.lock"))


def test_below_min_ranks_checkpoints_exits_75_and_resumes(toy_file, tmp_path, replay):
    out = str(tmp_path / "run")
    proc = ulfm_run(3, args(toy_file, out, "--set", "train.elastic.min_ranks=3"),
                    {"MPILEARN_TEST_KILL": f"2:{KILL_AFTER}"})
    assert proc.returncode == 75, proc.stderr
    assert "fewer than train.elastic.min_ranks=3" in proc.stderr
    assert open(os.path.join(out, "checkpoints", "latest")).read().strip() == \
        f"ckpt-e0000-s{KILL_AFTER:07d}.pt"
    resumed = mpirun(2, args(toy_file, out, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert_same(final_model(out), final_model(replay))


def test_elastic_refuses_what_cannot_survive(toy_file, tmp_path):
    proc = subprocess.run([sys.executable, *args(toy_file, str(tmp_path / "run"), "--set",
                                                 "train.elastic.min_ranks=1", "--set",
                                                 "train.algorithm=local_sgd")],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=ENV)
    assert proc.returncode == 2, proc.stderr
    assert "train.elastic: train.algorithm=local_sgd is not elastic" in proc.stderr


def test_horovod_elastic_torch_script_survives_kill9_of_rank0():
    """A script written for horovod.torch's elastic API (only its import names mpilearn)."""
    proc = ulfm_run(3, [os.path.join(TESTS, "scripts", "hvd_elastic_torch.py")],
                    {"MPILEARN_TEST_KILL": "0:7"})
    assert proc.returncode == 0, proc.stderr
    assert "hvd.elastic: lost rank 0 on " in proc.stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # every sample twice in two epochs: the batch in flight was rolled back to the commit
    assert result["seen"] == [2.0] and result["size"] == 2 and result["resets"] == [2]


def test_horovod_elastic_keras_script_survives_kill9():
    """A model.fit script written for horovod.tensorflow.keras's elastic API (KerasState, the
    three callbacks; only its import names mpilearn): rank 1 dies mid-epoch, the two survivors
    finish every epoch from the last commit with the same weights and the rescaled lr."""
    proc = ulfm_run(3, [os.path.join(TESTS, "scripts", "hvd_elastic_keras.py")],
                    {"MPILEARN_TEST_KILL": "1:3", "MPILEARN_ELASTIC_MIN_RANKS": "2",
                     "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("hvd.elastic: lost rank 1 on ") == 1, proc.stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"epoch": 3, "size": 2, "resets": [2], "same_weights": True,
                      "lr": pytest.approx(0.02)}


def test_horovods_own_tf2_elastic_example_survives_kill9(tmp_path):
    """Horovod's examples/elastic/tensorflow2/tensorflow2_synthetic_benchmark_elastic.py from
    Horovod's checkout (`make horovod` fetches it), only its import changed, under
    `mpilearn-run -np 2 --min-np 1`: rank 1 is killed from outside after Iter #1, rank 0
    finishes alone. The script is Keras 2's (`opt.lr`): tf_keras, as Horovod 0.28 needs."""
    relpath = "elastic/tensorflow2/tensorflow2_synthetic_benchmark_elastic.py"
    if not os.path.exists(os.path.join(horovod_examples.CHECKOUT, "examples", relpath)):
        pytest.fail(f"Horovod's checkout is not at {horovod_examples.CHECKOUT}: run `make "
                    "horovod` (make test builds it) or set HOROVOD_SRC")
    script = horovod_examples.example(relpath, tmp_path)
    argv = horovod_examples.launcher(2, 1, script, "--no-cuda", "--model", "MobileNet",
                                     "--batch-size", "2", "--num-warmup-batches", "1",
                                     "--num-batches-per-iter", "1", "--num-iters", "4")
    status, out = horovod_examples.run_and_kill(
        argv, script, {**ENV, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"},
        victim=1, when="Iter #1", timeout=240)
    assert status == 0, out[-3000:]
    assert out.count("hvd.elastic: lost rank 1 on ") == 1, out[-3000:]
    assert "Iter #3:" in out and "Total img/sec on 1 CPU(s)" in out, out[-3000:]
