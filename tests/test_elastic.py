"""Elastic training under real ``mpirun --with-ft ulfm`` and a real ``kill -9``: the survivors
finish on fewer ranks, every event is trained once per epoch, and the weights equal the replay
(stop at the agreed step at np=3, resume at np=2)."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import (ENV, PMIX_START_FAILURE, REPO, TESTS, mpirun, shared, train_args,
                      wait_until_gone)
from mpilearn.train import checkpoint as ckpt

KILL_AFTER = 20  # applied steps before the victim dies (even: the rest fills np=2's batches)


def args(toy_file, out, *extra):
    # 960 training events: 80 global batches of 12 at np=3, 120 of 8 at np=2
    return train_args("--set", f"model={TESTS}/models/elastic_mlp.py", "--set",
                      f"data.files=[{toy_file}]", "--set", "data.val_fraction=0.0625",
                      "--set", "train.epochs=2", "--set", "train.batch_size=4",
                      "--set", "train.deterministic=true", "--output", out, *extra)


def ulfm_run(np_, argv, env):
    for attempt in range(2):  # as conftest.mpirun: only a launcher that failed to start again
        proc = subprocess.run(["mpirun", "--with-ft", "ulfm", "-np", str(np_), "--oversubscribe",
                               *[a for k in env for a in ("-x", k)], sys.executable, *argv],
                              capture_output=True, text=True, timeout=300, cwd=REPO,
                              env={**ENV, **env})
        if PMIX_START_FAILURE not in proc.stderr:
            break
    return proc


def final_model(out):
    return ckpt.load(ckpt.latest(os.path.join(out, "checkpoints")))["task"]["models"]["model"]


def assert_same(got, want):
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def stop_and_resume(tmp_path_factory, name, toy_file, steps, before, after, *extra):
    """The replay, made once per session: stopped by a signal after exactly ``steps`` steps at
    np=``before``, resumed at np=``after``; the run directory."""
    def train(folder):
        out = str(folder / "run")
        stop = mpirun(before, args(toy_file, out, *extra),
                      env={"MPILEARN_TEST_STOP": str(steps)})
        assert stop.returncode == 75, stop.stderr
        proc = mpirun(after, args(toy_file, out, *extra, "--resume"))
        assert proc.returncode == 0, proc.stderr

    return str(shared(tmp_path_factory, name, train) / "run")


@pytest.fixture(scope="session")
def replay(toy_file, tmp_path_factory):
    """Stopped by a signal after exactly KILL_AFTER steps at np=3, resumed at np=2."""
    return stop_and_resume(tmp_path_factory, "elastic-replay", toy_file, KILL_AFTER, 3, 2)


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
    assert ("; rank 0 was lost: its duties (checkpoints, logs) moved to rank 0 (formerly rank 1)"
            in proc.stdout) == (victim == 0)
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
    # the launch's record is true after the loss, whoever was lost: finished (exit 0), three
    # processes, the lost one charged to its loss, before the survivors' end
    (launch,) = [json.loads(line) for line in open(os.path.join(out, "launches.jsonl"))]
    assert launch["exit"] == 0 and launch["ranks"] == 3 and launch["ranks_at_end"] == 2
    assert launch["lost"] == [victim] and launch["spawned"] == []
    seconds = launch["launched_s"]
    assert seconds[victim] < min(s for i, s in enumerate(seconds) if i != victim) - 0.5, seconds
    if victim == 0:  # and report says the membership history, whoever wrote it
        report = mpirun(1, ["-m", "mpilearn.report", out])
        assert report.returncode == 0, report.stderr
        assert "2 epoch(s) on 3 -> 2 cpu rank(s)" in report.stdout, report.stdout
        assert (f"membership: epoch 1, step {KILL_AFTER}: lost rank 0 on ") in report.stdout
        assert "(rank 0's duties moved); 3 -> 2 ranks, recovered in " in report.stdout
        assert "cost: launch 1: 3 cpu rank(s), 1 lost, ending on 2, each " in report.stdout


def test_a_rank_lost_in_an_epochs_first_step_does_not_end_the_epoch_before_twice(toy_file,
                                                                                  tmp_path):
    """Step 80 ends epoch 1 at np=3: the survivors go back to the state past its end (record,
    validation and checkpoint done), not to step 80's in-epoch snapshot."""
    out = str(tmp_path / "run")
    proc = ulfm_run(3, args(toy_file, out, "--set", "train.elastic.min_ranks=2"),
                    {"MPILEARN_TEST_KILL": "1:80"})
    assert proc.returncode == 0, proc.stderr
    assert "at step 81 (epoch 2); going on with 2 rank(s) from step 80, global batch 8" \
        in proc.stdout, proc.stdout
    assert [l for l in proc.stdout.splitlines() if l.startswith("epoch ")][:1] == \
        [l for l in proc.stdout.splitlines() if l.startswith("epoch 1:")], proc.stdout
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["epoch"] for r in records if "time" in r] == [1, 2]
    model = final_model(out)
    assert sorted(model["seen"].unique().tolist()) == [0.0, 2.0]
    assert int((model["seen"] == 2).sum()) == 960


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
                                                 "train.algorithm=downpour")],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=ENV)
    assert proc.returncode == 2, proc.stderr
    assert "train.elastic: train.algorithm=downpour is asynchronous and not elastic" in proc.stderr
    assert "use train.algorithm=allreduce or local_sgd" in proc.stderr


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
    return stop_and_resume(tmp_path_factory, "elastic-grow-replay", toy_file, GROW_AT, 2, 3,
                           *ONE_EPOCH)


def run_growing(toy_file, tmp_path, *extra, env=None, timeout=300):
    """mpilearn-run -np 2 --max-np 3 with a discovery script that offers a third slot after
    GROW_AT steps (the model file rewrites it, MPILEARN_TEST_GROW)."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    return subprocess.run(
        [sys.executable, "-m", "mpilearn.run", "-np", "2", "--min-np", "2", "--max-np", "3",
         "--host-discovery-script", str(script), sys.executable,
         *args(toy_file, str(tmp_path / "run"), *ONE_EPOCH, *extra)],
        capture_output=True, text=True, timeout=timeout, cwd=REPO,
        env={**ENV, "MPILEARN_DISCOVERY_INTERVAL": "0.5",
             "MPILEARN_TEST_GROW": f"{GROW_AT}:{hosts}:localhost:3", **(env or {})})


def grow_run(toy_file, tmp_path, env=None):
    """:func:`run_growing`, which must succeed and record the growth at step GROW_AT."""
    out = str(tmp_path / "run")
    proc = run_growing(toy_file, tmp_path, env=env)
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
    (launch,) = [json.loads(line) for line in open(os.path.join(out, "launches.jsonl"))]
    assert launch["exit"] == 0 and launch["ranks"] == 2 and launch["ranks_at_end"] == 3
    # the spawned process counts, from its own start: later than the others'
    assert launch["spawned"] == [2] and launch["lost"] == [] and len(launch["devices"]) == 3
    assert 0 < launch["launched_s"][2] < min(launch["launched_s"][:2]), launch
    assert_every_event_once_equal_to(out, grow_replay)


def test_a_newcomer_that_hangs_before_it_joins_is_ended_by_the_watchdog(toy_file, tmp_path):
    """The spawned rank hangs as it builds its model: the two ranks waiting for it in the
    growth are watched as in a step, and the watchdog ends the job (124, its line) instead of
    the job waiting for good (ULFM does not report a spawned process's failure)."""
    proc = run_growing(toy_file, tmp_path, "--set", "train.watchdog.floor_s=10",
                       "--set", "train.watchdog.factor=2",
                       env={"MPILEARN_TEST_HANG_SPAWNED": "1"}, timeout=240)
    assert proc.returncode == 124, proc.stderr[-3000:]
    # a growth gets a start-up's patience: factor x floor = 20 s, not the steps' 10 s
    assert re.search(r"mpilearn: watchdog: rank [01] on \S+ made no progress for \d+ s \(limit "
                     r"20 s\): waiting in a collective at allreduce_int \(\S+membership\.py:",
                     proc.stderr), proc.stderr[-3000:]
    # the launcher did not end the grown job after the abort: mpilearn-run did, the spawned
    # rank (its own process group) with it
    assert "the launcher has not ended the job 10 s later; killing it" in proc.stderr
    wait_until_gone(tmp_path, timeout=10)


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


SYNC_EVERY, AVERAGED = 3, 18  # local SGD averages after steps 3, 6, ..., 18, 21: the kill after
# step 20 lands between two averages, and the survivors redo 19-21 from the average of 18


def test_local_sgd_kill9_goes_back_to_the_last_average_equal_to_replay(toy_file, tmp_path):
    """Local SGD's snapshots are its averages (every rank holds the same model there): rank 1 of
    3 dies in step 21, the survivors go on from step 18's average on 2 ranks; the weights (Adam:
    rank 0's optimizer state at the new size) equal a stop at step 18 resumed at np=2."""
    def local(out, *extra):
        return args(toy_file, str(out), *ONE_EPOCH, "--set", "train.algorithm=local_sgd",
                    "--set", f"train.sync_every={SYNC_EVERY}", *extra)

    replay = tmp_path / "replay"
    stop = mpirun(3, local(replay), env={"MPILEARN_TEST_STOP": str(AVERAGED)})
    assert stop.returncode == 75, stop.stderr
    resumed = mpirun(2, local(replay, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    out = tmp_path / "run"
    proc = ulfm_run(3, local(out, "--set", "train.elastic.min_ranks=2"),
                    {"MPILEARN_TEST_KILL": f"1:{KILL_AFTER}"})
    assert proc.returncode == 0, proc.stderr
    assert f"snapshot every {SYNC_EVERY} step(s) (local SGD's averages)" in proc.stdout
    assert (f"at step {KILL_AFTER + 1} (epoch 1); going on with 2 rank(s) from step {AVERAGED}, "
            "global batch 8") in proc.stdout, proc.stdout
    change = [json.loads(line) for line in open(out / "metrics.jsonl") if "membership" in line]
    assert [(r["step"], r["position"]) for r in change] == [(AVERAGED, 12 * AVERAGED)]
    model = final_model(str(out))
    # every training event once: the redone steps' counts went back with the weights
    assert sorted(model["seen"].unique().tolist()) == [0.0, 1.0]
    assert int((model["seen"] == 1).sum()) == 960
    assert_same(model, final_model(str(replay)))


def keras_args(toy_file, out, *extra):
    # 960 training events: 20 global batches of 48 at np=3; after 6, the 672 left are 21 of 32;
    # a checkpoint every 6 steps, all 5 kept: the one of step 6 starts the replay
    return train_args("--set", f"model={TESTS}/models/elastic_keras.py", "--set",
                      f"data.files=[{toy_file}]", "--set", "data.val_fraction=0.0625",
                      "--set", "train.epochs=1", "--set", "train.batch_size=16", "--set",
                      "train.checkpoint_every_steps=6", "--set", "train.keep_checkpoints=5",
                      "--set", "train.deterministic=true", "--output", out, *extra)


def test_a_keras_task_survives_a_kill9_equal_to_its_replay(toy_file, tmp_path):
    """A float64 Keras MLP with dropout on TensorFlow: rank 1 of 3 killed after step 6; the two
    survivors train every event once and end with the replay's weights bit for bit: optimizer
    variables, the Keras allreduce's communicator and the dropout stream (restarted at the new
    size, as a resume does) all came back right. The replay resumes at 2 ranks from the
    checkpoint the run wrote at step 6 (what a stop there writes: one np=3 launch of
    TensorFlow ranks less)."""
    env = {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = str(tmp_path / "run")
    proc = ulfm_run(3, keras_args(toy_file, out, "--set", "train.elastic.min_ranks=2"),
                    {**env, "MPILEARN_TEST_KILL": "1:6"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("at step 7 (epoch 1); going on with 2 rank(s) from step 6, global batch 32, "
            "lr 0.01") in proc.stdout, proc.stdout
    change = [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl")))
              if "membership" in r]
    assert len(change) == 1 and change[0]["step"] == 6 and change[0]["position"] == 6 * 48
    step6 = os.path.join("checkpoints", ckpt.name_for(0, 6))
    os.makedirs(tmp_path / "replay" / "checkpoints")
    shutil.copy(os.path.join(out, step6), tmp_path / "replay" / step6)
    replay = str(tmp_path / "replay")
    resumed = mpirun(2, keras_args(toy_file, replay, "--resume"), env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "saved in epoch 1 after step 6 of it: going on with its step 7" in resumed.stdout
    got, want = final_model(out), final_model(replay)
    seen = next(w for w in got if w.shape == (1024,))
    assert sorted(seen.unique().tolist()) == [0.0, 1.0] and int(seen.sum()) == 960
    assert len(got) == len(want) == 5 and got[0].dtype == torch.float64
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
def test_a_rank_lost_during_start_up_ends_the_job_with_one_line_and_75_then_relaunched(
        toy_file, tmp_path):
    """Rank 0 dies as it builds the model (start-up: no snapshot yet to go back to): the
    survivors agree on who is lost, the lowest one says it once, every one exits 75 without a
    traceback, and mpilearn-run (ULFM mode) relaunches the job, which trains every event once
    (the lock the lost rank 0 held is taken over)."""
    out = str(tmp_path / "run")
    proc = subprocess.run(
        [sys.executable, "-m", "mpilearn.run", "-np", "3", "--min-np", "2", sys.executable,
         *args(toy_file, out, *ONE_EPOCH)], capture_output=True, text=True, timeout=300,
        cwd=REPO, env={**ENV, "MPILEARN_TEST_KILL_AT_START": f"0:{tmp_path / 'killed-once'}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert " --with-ft ulfm " in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mpilearn: lost")]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("mpilearn: lost rank 0 on ") and \
        "during start-up (3 -> 2 ranks); nothing trained was lost" in lines[0], lines[0]
    relaunched = [line for line in proc.stderr.splitlines() if "relaunching" in line]
    assert len(relaunched) == 1 and re.fullmatch(
        r"mpilearn-run: the job lost rank 0 on \S+ during start-up \(3 -> 2 ranks\), exit 75; "
        r"relaunching it with --resume auto \(restart 1 of 3\)", relaunched[0]), proc.stderr
    model = final_model(out)
    assert int((model["seen"] == 1).sum()) == 960


@pytest.fixture(scope="session")
def replay_4_to_2(toy_file, tmp_path_factory):
    """One epoch stopped by a signal after exactly KILL_AFTER steps at np=4, resumed at np=2."""
    return stop_and_resume(tmp_path_factory, "elastic-replay-4-2", toy_file, KILL_AFTER, 4, 2,
                           *ONE_EPOCH)


def test_a_second_loss_during_the_recovery_is_recovered_from_too(toy_file, tmp_path,
                                                                   replay_4_to_2):
    """np=4: rank 1 dies mid-epoch, rank 2 as the survivors recover (after the shrink, before
    they agree on the step): the recovery starts again with the two left, and the run finishes
    with one membership change naming both, equal to its replay."""
    out = str(tmp_path / "run")
    proc = ulfm_run(4, args(toy_file, out, *ONE_EPOCH, "--set", "train.elastic.min_ranks=2"),
                    {"MPILEARN_TEST_KILL": f"1:{KILL_AFTER}",
                     "MPILEARN_TEST_KILL_IN_RECOVERY": "2"})
    assert proc.returncode == 0, proc.stderr
    assert len(re.findall(rf"mpilearn: lost rank 1 on \S+, rank 2 on \S+ at step {KILL_AFTER + 1} "
                          rf"\(epoch 1\); going on with 2 rank\(s\) from step {KILL_AFTER}, "
                          "global batch 8", proc.stdout)) == 1, proc.stdout
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    change = [r["membership"] for r in records if "membership" in r]
    assert len(change) == 1 and change[0]["lost_ranks"] == [1, 2], change
    assert (change[0]["old_size"], change[0]["ranks"]) == (4, 2)
    model = final_model(out)
    assert int((model["seen"] == 1).sum()) == 960
    assert_same(model, final_model(replay_4_to_2))
