"""The jobs/ scripts on a real one-node SLURM cluster: srun and mpirun launches, requeue on a
stop signal, resume to the same result as an uninterrupted run."""
import json
import os
import shutil
import time

import pytest
import torch
import yaml

from conftest import ENV, REPO, TESTS, mpirun, rank_pid, train_args
from mpilearn.core.io import read_jsonl
from mpilearn.train import checkpoint as ckpt
from slurm_cluster import Cluster, missing

ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def slurm():
    need = missing()
    if need:
        if ROOT and shutil.which("apt-get"):
            pytest.fail(f"SLURM test cluster: {', '.join(need)} missing; `make test` installs "
                        "slurm-wlm, munge and libpmix-dev (make slurm-packages)")
        pytest.skip(f"*** SLURM TESTS SKIPPED: {', '.join(need)} missing and this user cannot "
                    "apt-get install them (needs root): the jobs/ scripts are NOT tested here ***")
    cluster = Cluster(preemption=True).start()
    try:
        yield cluster
    finally:
        cluster.stop()
        assert cluster.processes() == [], "SLURM daemons left running"


def submit(slurm, tmp_path, script, *args, flags=(), env=None):
    env = {**ENV, "MPILEARN_VENV": os.path.join(REPO, ".venv"), **(env or {})}
    env.pop("SLURM_CONF", None)
    return slurm.sbatch(f"--chdir={REPO}", f"--output={tmp_path}/slurm-%j.out", *flags,
                        os.path.join(REPO, "jobs", script), *args, env=env)


def log_of(tmp_path, job):
    with open(tmp_path / f"slurm-{job}.out") as f:
        return f.read()


def wait_for(path, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return
        time.sleep(0.2)
    raise AssertionError(f"{path} did not appear within {timeout} s")


def train_config(tmp_path, toy_file, **train):
    cfg = {"model": f"{TESTS}/models/slow.py", "hparams": {"sleep": 0.0},
           "data": {"files": [toy_file]},
           "train": {"epochs": 2, "batch_size": 16, "deterministic": True, **train}}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def sweep_config(tmp_path, toy_file):
    """jobs/hpo-mlp.yaml's layout (2 blocks x 2 folds + coordinator = 5 ranks), budget 4, on
    the slow MLP. 8 steps of 0.1 s an epoch: after the first epoch's metrics appear, three more
    epochs leave a signal or a kill time to reach the ranks while the first trials are still
    in flight."""
    base = yaml.safe_load(open(os.path.join(REPO, "jobs", "hpo-mlp.yaml")))
    cfg = {"model": f"{TESTS}/models/slow.py", "hparams": {"sleep": 0.1},
           "data": {"files": [toy_file]}, "train": {"epochs": 4, "batch_size": 64},
           "search": {**base["search"], "budget": 4}}
    path = tmp_path / "hpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_srun_training_job_as_a_chain_of_two(slurm, toy_file, tmp_path):
    """jobs/chain.sh: link 1 trains (srun, 2 tasks); link 2 starts after it, finds the run
    finished and exits at once."""
    out = tmp_path / "run"
    env = {**ENV, "MPILEARN_VENV": os.path.join(REPO, ".venv")}
    proc = slurm.run(["bash", os.path.join(REPO, "jobs", "chain.sh"), "2", f"--chdir={REPO}",
                      f"--output={tmp_path}/slurm-%j.out", os.path.join(REPO, "jobs", "train.sbatch"),
                      train_config(tmp_path, toy_file), str(out)], env=env)
    first, second = [line.split()[-1] for line in proc.stdout.splitlines() if line.startswith("link")]
    assert slurm.job(second)["Dependency"].startswith(f"afterany:{first}")
    for job in (first, second):
        info = slurm.wait(job)
        log = log_of(tmp_path, job)
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert f"launcher srun, 2 process(es) (SLURM job {first}); 2 rank(s) on this node" in log_of(tmp_path, first)
    assert "done after 2 epoch(s)" in log_of(tmp_path, second)
    records = read_jsonl(str(out / "metrics.jsonl"))
    assert [r["epoch"] for r in records] == [1, 2] and all(r["ranks"] == 2 for r in records)


def test_requeued_training_job_ends_where_an_uninterrupted_run_ends(slurm, toy_file, tmp_path):
    config = train_config(tmp_path, toy_file, epochs=3, checkpoint_every_steps=0)
    # hparams.sleep slows each step so that the signal lands mid-epoch
    slow = ["--set", "hparams.sleep=0.03"]
    whole = tmp_path / "whole"
    proc = mpirun(2, train_args("--config", config, "--output", str(whole), *slow))
    assert proc.returncode == 0, proc.stderr

    out = tmp_path / "requeued"
    job = submit(slurm, tmp_path, "train.sbatch", config, str(out), *slow)
    wait_for(out / "metrics.jsonl")  # the first epoch is done
    slurm.run(["scancel", "--signal=TERM", job])  # what SLURM sends at the time limit
    slurm.skip_requeue_hold(job)
    info = slurm.wait(job)
    log = log_of(tmp_path, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log + slurm.logs()
    assert "mpilearn: stopped by SIGTERM; checkpoint " in log
    assert f"requeueing job {job}" in log and "restart 1 on" in log and "resumed from" in log
    got = ckpt.load(ckpt.latest(str(out / "checkpoints")))["task"]["models"]["model"]
    want = ckpt.load(ckpt.latest(str(whole / "checkpoints")))["task"]["models"]["model"]
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    assert [r["epoch"] for r in read_jsonl(str(out / "metrics.jsonl"))] == [1, 2, 3]


def test_mpirun_sweep_inside_the_allocation_survives_a_requeue(slurm, toy_file, tmp_path):
    path = sweep_config(tmp_path, toy_file)
    out = tmp_path / "sweep"
    job = submit(slurm, tmp_path, "hpo-mpirun.sbatch", str(path), str(out))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not list(out.glob("trials/*/fold*/metrics.jsonl")):
        time.sleep(0.2)
    # the early-warning signal goes to the batch shell, which passes it on through mpirun
    slurm.run(["scancel", "--batch", "--signal=USR1", job])
    slurm.skip_requeue_hold(job)
    info = slurm.wait(job, timeout=400)
    log = log_of(tmp_path, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log + slurm.logs()
    events = read_jsonl(str(out / "journal.jsonl"))
    interrupted = {r["key"] for r in events if r["event"] == "interrupted"}
    done = [r["key"] for r in events if r["event"] == "done"]
    assert interrupted and len(done) == 4 and len(set(done)) == 4 and interrupted <= set(done), log
    assert "sweep stopped" in log and "sweep finished: 4 trials (4 done" in log


def test_a_sweep_whose_rank_was_killed_requeues_itself_and_finishes(slurm, toy_file, tmp_path):
    """kill -9 of a block rank mid-trial (as the OOM killer does) without ULFM: the whole job
    ends, the script requeues it (a crash, within max_restarts), and the sweep resumes from its
    journal to exactly its budget."""
    path = sweep_config(tmp_path, toy_file)
    out = tmp_path / "sweep"
    marker = f"MPILEARN_TEST_MARK={tmp_path}"
    job = submit(slurm, tmp_path, "hpo-mpirun.sbatch", str(path), str(out),
                 env={"MPILEARN_TEST_MARK": str(tmp_path)})
    victim = rank_pid(marker, 1)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not list(out.glob("trials/*/fold*/metrics.jsonl")):
        time.sleep(0.2)
    os.kill(victim, 9)
    slurm.skip_requeue_hold(job)
    info = slurm.wait(job, timeout=400)
    log = log_of(tmp_path, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log + slurm.logs()
    assert "restart 1 of at most 3 after a crash: requeueing job" in log, log
    events = read_jsonl(str(out / "journal.jsonl"))
    done = [r["key"] for r in events if r["event"] == "done"]
    assert len(done) == 4 and len(set(done)) == 4, log


def test_scancel_stops_for_good_one_writer_and_a_preempted_job_resumes(slurm, toy_file, tmp_path):
    """One run directory, three jobs: a second job submitted while the first trains exits 2
    naming it; a plain scancel leaves the first CANCELLED (not requeued) with one line and a
    checkpoint; the same sbatch again resumes; preempted (PreemptMode=REQUEUE), that job is
    requeued and resumes; every epoch is logged once."""
    epochs = 12
    config = train_config(tmp_path, toy_file, epochs=epochs, max_steps_per_epoch=10)
    slow = ["--set", "hparams.sleep=0.25"]  # 2.5 s an epoch
    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"
    first = submit(slurm, tmp_path, "train.sbatch", config, str(out), *slow)
    wait_for(metrics)
    second = submit(slurm, tmp_path, "train.sbatch", config, str(out), *slow)
    info = slurm.wait(second)
    log = log_of(tmp_path, second)
    assert info["ExitCode"] == "2:0" and slurm.job(first)["JobState"] == "RUNNING", log
    refusal = [line for line in log.splitlines() if "being written by another job" in line]
    assert len(refusal) == 1, log
    assert (f"(host {slurm.host}, PID " in refusal[0] and f", SLURM job {first}, started "
            in refusal[0] and f"scancel {first}" in refusal[0]), refusal

    slurm.run(["scancel", first])
    info = slurm.wait(first)
    log = log_of(tmp_path, first)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", log
    saved = ckpt.latest(str(out / "checkpoints"))
    cancelled = [line for line in log.splitlines() if "cancelled (" in line]
    assert len(cancelled) == 1 and f"job {first} was cancelled" in cancelled[0], log
    assert f"its state is saved in {saved};" in cancelled[0] and "requeueing" not in log, log
    assert ckpt.load(saved)["step_in_epoch"] > 0  # the position at the cancel, mid-epoch
    assert not (out / ".mpilearn.lock").exists() and not (out / f"hosts-{first}").exists()
    time.sleep(2)
    assert slurm.job(first)["JobState"] == "CANCELLED"  # and it stays so

    third = submit(slurm, tmp_path, "train.sbatch", config, str(out), *slow)
    logged = len(read_jsonl(str(metrics)))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and len(read_jsonl(str(metrics))) <= logged:
        time.sleep(0.2)
    # a job of a higher-priority partition wants every CPU: the third job is preempted
    slurm.sbatch("--partition=urgent", f"--ntasks={slurm.cpus}", "--output=/dev/null",
                 "--wrap", "sleep 1")
    slurm.skip_requeue_hold(third)
    info = slurm.wait(third)
    log = log_of(tmp_path, third)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log + slurm.logs()
    assert log.count("resumed from") == 2 and "restart 1 on" in log, log
    assert "was cancelled" not in log, log
    records = [r for r in read_jsonl(str(metrics)) if "time" in r]
    assert [r["epoch"] for r in records] == list(range(1, epochs + 1)), records


def test_a_job_whose_rank_was_killed_requeues_itself_and_finishes(slurm, toy_file, tmp_path):
    """kill -9 of one rank (as the OOM killer does) in the job's first run: the script requeues
    it (a crash, within the site's max_restarts) and the next run resumes and finishes."""
    config = train_config(tmp_path, toy_file, epochs=2, checkpoint_every_steps=2)
    out = tmp_path / "run"
    job = submit(slurm, tmp_path, "train.sbatch", config, str(out),
                 "--set", f"model={TESTS}/models/crash.py",
                 "--set", "hparams={kill_first_run: true}")
    slurm.skip_requeue_hold(job)
    info = slurm.wait(job)
    log = log_of(tmp_path, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log + slurm.logs()
    assert "restart 1 of at most 3 after a crash: requeueing job" in log, log
    assert "resumed from" in log and "restart 1 on" in log, log
    assert [r["epoch"] for r in read_jsonl(str(out / "metrics.jsonl")) if "time" in r] == [1, 2]


def test_an_elastic_job_rendered_for_mpirun_survives_a_killed_rank(slurm, toy_file, tmp_path):
    """train.elastic.min_ranks set at render time: the script launches `mpirun --with-ft ulfm`
    and runs the config it rendered; a rank killed by SIGKILL costs neither the job nor a
    requeue: the survivor finishes both epochs on 1 rank."""
    config = train_config(tmp_path, toy_file, epochs=2)
    script = tmp_path / "elastic.sbatch"
    render = mpirun(1, ["-m", "mpilearn.jobs", "--kind", "train", "--config", config,
                        "--site", os.path.join(REPO, "jobs", "site-example.yaml"),
                        "--launcher", "mpirun", "--set", "train.elastic.min_ranks=1",
                        "--set", f"model={TESTS}/models/crash.py",
                        "--set", "hparams={kill_first_run: true}"])
    assert render.returncode == 0, render.stderr
    assert "--with-ft ulfm" in render.stdout and "--set train.elastic.min_ranks=1" in render.stdout
    script.write_text(render.stdout)
    out = tmp_path / "run"
    env = {**ENV, "MPILEARN_VENV": os.path.join(REPO, ".venv")}
    env.pop("SLURM_CONF", None)
    job = slurm.sbatch(f"--chdir={REPO}", f"--output={tmp_path}/slurm-%j.out", "--ntasks=2",
                       str(script), config, str(out), env=env)
    info = slurm.wait(job)
    log = log_of(tmp_path, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", log + slurm.logs()
    assert "mpilearn: lost rank 1 on " in log and "going on with 1 rank(s)" in log, log
    records = read_jsonl(str(out / "metrics.jsonl"))
    assert [r["membership"]["lost_ranks"] for r in records if "membership" in r] == [[1]]
    assert [r["epoch"] for r in records if "time" in r] == [1, 2]
