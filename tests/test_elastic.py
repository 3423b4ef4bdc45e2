"""Elastic training under real ``mpirun --with-ft ulfm`` and a real ``kill -9``: the survivors
finish on fewer ranks, every event is trained once per epoch, and the weights equal the replay
(stop at the agreed step at np=3, resume at np=2)."""
import json
import os
import subprocess
import sys

import pytest
import torch

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


def test_the_3dgan_survives_a_kill9_equal_to_its_replay_to_float_rounding(showers_dir, tmp_path):
    """Two models, two optimizers and four updates a step: rank 1 of 3 killed after step 2; the
    survivors' weights equal the replay (stopped at step 2 at 3 ranks, resumed at 2)."""
    first = sorted(os.listdir(showers_dir))[0]

    def gan(out, *extra):
        return train_args("--set", f"model={TESTS}/models/gan_armed.py", "--set",
                          f"data.files=[{os.path.join(showers_dir, first)}]", "--set",
                          "data.val_fraction=0.25", "--set", "hparams.preset=small", "--set",
                          "train.batch_size=4", "--set", "train.deterministic=true",
                          "--output", str(out), *extra)

    replay = tmp_path / "replay"
    stop = mpirun(3, gan(replay), env={"MPILEARN_TEST_STOP": "2"})
    assert stop.returncode == 75, stop.stderr
    resumed = mpirun(2, gan(replay, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    out = tmp_path / "run"
    proc = ulfm_run(3, gan(out, "--set", "train.elastic.min_ranks=2"), {"MPILEARN_TEST_KILL": "1:2"})
    assert proc.returncode == 0, proc.stderr
    assert "going on with 2 rank(s) from step 2" in proc.stdout, proc.stdout
    got = ckpt.load(ckpt.latest(str(out / "checkpoints")))["task"]
    want = ckpt.load(ckpt.latest(str(replay / "checkpoints")))["task"]
    for name in want["models"]:  # the generator and the discriminator
        for k, v in want["models"][name].items():
            torch.testing.assert_close(got["models"][name][k], v)


GROW_AT = 30  # steps at np=2 before the growth (8 * 30 events leave 60 batches of 12)
ONE_EPOCH = ("--set", "train.epochs=1")  # enough to see every event once, and cheaper


@pytest.fixture(scope="session")
def grow_replay(toy_file, tmp_path_factory):
    """Stopped by a signal after exactly GROW_AT steps at np=2, resumed at np=3."""
    def train(folder):
        out = str(folder / "run")
        stop = mpirun(2, args(toy_file, out, *ONE_EPOCH),
                      env={"MPILEARN_TEST_STOP": str(GROW_AT)})
        assert stop.returncode == 75, stop.stderr
        proc = mpirun(3, args(toy_file, out, *ONE_EPOCH, "--resume"))
        assert proc.returncode == 0, proc.stderr

    return str(shared(tmp_path_factory, "elastic-grow-replay", train) / "run")


def grow_run(toy_file, tmp_path, env=None):
    """mpilearn-run -np 2 --max-np 3 with a discovery script that offers a third slot after
    GROW_AT steps (the model file rewrites it, MPILEARN_TEST_GROW)."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    out = str(tmp_path / "run")
    proc = subprocess.run(
        [sys.executable, "-m", "mpilearn.run", "-np", "2", "--min-np", "2", "--max-np", "3",
         "--host-discovery-script", str(script), sys.executable,
         *args(toy_file, out, *ONE_EPOCH)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**ENV, "MPILEARN_DISCOVERY_INTERVAL": "0.5",
             "MPILEARN_TEST_GROW": f"{GROW_AT}:{hosts}:localhost:3", **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert " --with-ft ulfm " in proc.stderr  # the ULFM mode (its command line)
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    change = [r for r in records if "membership" in r]
    assert change[0]["membership"]["old_size"] == 2
    assert change[0]["membership"]["ranks"] == 3 and change[0]["step"] == GROW_AT
    assert change[0]["position"] == 8 * GROW_AT and change[0]["global_batch"] == 12
    return proc, out, [c["membership"] for c in change]


def assert_every_event_once(out):
    model = final_model(out)
    assert sorted(model["seen"].unique().tolist()) == [0.0, 1.0]
    assert int((model["seen"] == 1).sum()) == 960
    return model


def assert_every_event_once_equal_to(out, replay_out):
    assert_same(assert_every_event_once(out), final_model(replay_out))


def test_growth_from_2_to_3_ranks_spawned_in_process(toy_file, tmp_path, grow_replay):
    """The discovery script offers a third slot: the two ranks spawn it (MPI_Comm_spawn), send
    it the run and go on at 3 ranks from the same step, in one launch; the weights equal the
    stop-and-resume replay."""
    proc, out, (record,) = grow_run(toy_file, tmp_path)
    assert "relaunching" not in proc.stderr + proc.stdout
    assert proc.stdout.count(f"mpilearn: grew to 3 ranks at step {GROW_AT} (epoch 1): spawned "
                             "rank 2 on ") == 1, proc.stdout
    assert record["added_ranks"] == [2] and record["spawned"] is True
    launches = [json.loads(line) for line in open(os.path.join(out, "launches.jsonl"))]
    assert len(launches) == 1 and launches[0]["exit"] == 0
    assert_every_event_once_equal_to(out, grow_replay)


def test_growth_falls_back_to_a_relaunch_where_the_ranks_cannot_spawn(toy_file, tmp_path,
                                                                       grow_replay):
    """MPILEARN_SPAWN=0 (as where a launcher cannot spawn): the job stops at the growth's step
    with a checkpoint, and mpilearn-run relaunches it at 3 ranks with --resume auto."""
    proc, out, (record,) = grow_run(toy_file, tmp_path, {"MPILEARN_SPAWN": "0"})
    assert proc.stderr.count("mpilearn-run: growing from 2 to 3 ranks on localhost:3") == 1
    assert ("stopped by the host discovery script (3 slots: growing to 3 ranks); not growing "
            "in process (MPILEARN_SPAWN=0): relaunching; checkpoint ") in proc.stdout
    assert record["relaunched"]
    assert_every_event_once_equal_to(out, grow_replay)


@pytest.mark.parametrize("hosts", ["localhost:3", ""])
def test_spawn_merges_a_rank_after_the_others_or_every_rank_sees_the_refusal(hosts):
    """membership.spawn under a real mpirun with 2 slots: with a third slot added
    (PMIX_ADD_HOST) the newcomer is rank 2 of the merged communicator and knows it joined;
    without one, every rank gets the MPI error that turns a growth into the relaunch."""
    env = {k: v for k, v in ENV.items() if "oversubscribe" not in (k + v).lower()}
    proc = subprocess.run(["mpirun", "--with-ft", "ulfm", "-np", "2", "-H", "localhost:2",
                           "--bind-to", "none", sys.executable,
                           os.path.join(TESTS, "scripts", "spawn_ranks.py"), hosts],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    lines = sorted(proc.stdout.splitlines())
    if hosts:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert [json.loads(line) for line in lines] == [
            {"rank": r, "size": 3, "spawned": [False, False, True]} for r in range(3)]
    else:  # mpirun then exits 213, whatever the ranks' status: mpilearn-run reads rank 0's
        assert [json.loads(line) for line in lines] == [{"refused": "MPI_ERR_UNKNOWN: unknown "
                                                                   "error"}] * 2, proc.stderr


def test_a_spawned_rank_killed_after_the_growth_is_survived(toy_file, tmp_path):
    """The rank spawned at step GROW_AT is killed after 10 steps of its own: the two first
    ranks shrink back and finish, every event once; mpilearn-run exits with the job's own
    status, not mpirun's 137 for the spawned rank (open-mpi/ompi#13325)."""
    proc, out, (grown, lost) = grow_run(toy_file, tmp_path, {"MPILEARN_TEST_KILL": "spawned:10"})
    assert f"grew to 3 ranks at step {GROW_AT} (epoch 1)" in proc.stdout
    assert (f"mpilearn: lost rank 2 on {grown['added_hosts'][0]} at step {GROW_AT + 11} (epoch "
            f"1); going on with 2 rank(s) from step {GROW_AT + 10}, global batch 8") in proc.stdout
    assert lost["lost_ranks"] == [2] and lost["ranks"] == 2
    assert "the job's own status is 0" in proc.stderr
    assert_every_event_once(out)


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
