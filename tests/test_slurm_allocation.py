"""The jobs/ scripts on the real one-node SLURM: sizes come from the allocation (sbatch flags
resize a job, a sweep that does not fit is refused naming both), and staging is a transport
detail (a staged three-link chain is one run, bit for bit)."""
import os
import subprocess
import sys
import time

import torch
import yaml

from conftest import ENV, REPO, TESTS, mpirun, train_args
from mpilearn.core.io import read_jsonl
from mpilearn.train import checkpoint as ckpt
from test_slurm import log_of, slurm, submit  # noqa: F401  (slurm: the cluster fixture)


def sweep_config(tmp_path, toy_file, blocks):
    base = yaml.safe_load(open(os.path.join(REPO, "jobs", "hpo-mlp.yaml")))
    # 4 epochs of 8 steps of 0.1 s: a trial is still in flight when the test scancels
    cfg = {"model": f"{TESTS}/models/slow.py", "hparams": {"sleep": 0.1},
           "data": {"files": [toy_file]}, "train": {"epochs": 4, "batch_size": 64},
           "search": {**base["search"], "budget": 2, "blocks": blocks}}
    path = tmp_path / f"hpo-{blocks}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_a_sweep_takes_its_ranks_from_the_allocation(slurm, toy_file, tmp_path):
    """jobs/hpo.sbatch was rendered for 5 tasks; sbatch --ntasks=3 runs a 1-block sweep on 3
    ranks (through a scancel and a requeue), and refuses a 2-block one at job start with one
    message naming both."""
    refused = submit(slurm, tmp_path, "hpo.sbatch", sweep_config(tmp_path, toy_file, 2),
                     str(tmp_path / "refused"), flags=["--ntasks=3"])
    info = slurm.wait(refused)
    log = log_of(tmp_path, refused)
    assert info["ExitCode"] == "2:0", log
    assert log.count("mpilearn: error:") == 1, log
    assert "needs 5 task(s) (1 coordinator + 2 block(s) x 2 rank(s) per trial)" in log, log
    assert "the allocation has 3 task(s) on 1 node(s)" in log and "search.blocks=1" in log, log
    assert not (tmp_path / "refused" / "journal.jsonl").exists()

    # the journey: the resized sweep is scancelled mid-trial (SIGTERM to the step, what SLURM
    # sends at the time limit), requeues itself, and ends with every trial once
    out = tmp_path / "fits"
    job = submit(slurm, tmp_path, "hpo.sbatch", sweep_config(tmp_path, toy_file, 1), str(out),
                 flags=["--ntasks=3"])
    wait_for_epoch_anywhere(out)
    slurm.run(["scancel", "--signal=TERM", job])
    slurm.skip_requeue_hold(job)
    info = slurm.wait(job, timeout=400)
    log = log_of(tmp_path, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log + slurm.logs()
    assert info["Restarts"] == "1" and "launcher srun, 3 process(es)" in log, log
    events = read_jsonl(str(out / "journal.jsonl"))
    interrupted = {r["key"] for r in events if r["event"] == "interrupted"}
    done = [r["key"] for r in events if r["event"] == "done"]
    assert interrupted and len(done) == 2 and len(set(done)) == 2 and interrupted <= set(done), log


def wait_for_epoch_anywhere(sweep, timeout=240):
    """Until some fold of the sweep has written its first epoch's metrics."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if list(sweep.glob("trials/*/fold*/metrics.jsonl")):
            return
        time.sleep(0.2)
    raise AssertionError(f"no fold of {sweep} wrote metrics within {timeout} s")


def wait_for_epoch(path, epoch, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and any(r["epoch"] >= epoch for r in read_jsonl(str(path))):
            return
        time.sleep(0.2)
    raise AssertionError(f"epoch {epoch} not in {path} within {timeout} s")


def test_a_staged_three_link_chain_is_one_run(slurm, tmp_path):
    """Training data staged per link (two files named alike, and validation files) to a
    directory that changes with each job id; each link is stopped mid-run and the next resumes
    (jobs/chain.sh). The weights equal an uninterrupted run's, exactly, in float64; the run's
    config names the sources; every stage is removed at its link's end. Three ranks where
    the script was rendered for two: the allocation's size is used."""
    from mpilearn.data.toy import write_regression

    files = [write_regression(str(tmp_path / d / "part.h5"), events=480, seed=i)
             for i, d in enumerate(("a", "b"))]
    val = write_regression(str(tmp_path / "val" / "part.h5"), events=96, seed=7)
    # 20 steps of 0.1 s an epoch: a signal sent after an epoch's metrics lands in the next
    cfg = {"model": f"{TESTS}/models/slow64.py", "hparams": {"sleep": 0.1},
           "data": {"files": files, "val_files": [val]},
           "train": {"epochs": 3, "batch_size": 16, "deterministic": True,
                     "checkpoint_every_steps": 0}}
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(cfg))
    whole = tmp_path / "whole"
    proc = mpirun(3, train_args("--config", str(config), "--output", str(whole)))
    assert proc.returncode == 0, proc.stderr

    stage = tmp_path / "stage"
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"stage_to": str(stage)}))
    script = tmp_path / "train.sbatch"
    rendered = subprocess.run([sys.executable, "-m", "mpilearn.jobs", "--config", str(config),
                               "--site", str(site)], cwd=REPO, capture_output=True, text=True)
    assert rendered.returncode == 0, rendered.stderr
    script.write_text(rendered.stdout)
    out = tmp_path / "run"
    env = {**ENV, "MPILEARN_VENV": os.path.join(REPO, ".venv")}
    env.pop("SLURM_CONF", None)
    chain = slurm.run(["bash", os.path.join(REPO, "jobs", "chain.sh"), "3", f"--chdir={REPO}",
                       "--ntasks=3", "--ntasks-per-node=3", f"--output={tmp_path}/slurm-%j.out",
                       str(script),
                       str(config), str(out)], env=env)
    links = [line.split()[-1] for line in chain.stdout.splitlines() if line.startswith("link")]
    for i, job in enumerate(links[:2]):  # stop links 1 and 2 after one more epoch each
        wait_for_epoch(out / "metrics.jsonl", i + 1)
        slurm.run(["scancel", "--signal=TERM", job])
        info = slurm.wait(job)
        assert info["ExitCode"] == "75:0", log_of(tmp_path, job) + slurm.logs()
    info = slurm.wait(links[2])
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", \
        log_of(tmp_path, links[2]) + slurm.logs()
    for i, job in enumerate(links):
        log = log_of(tmp_path, job)
        assert "staged 3 file(s)" in log and str(stage / f"mpilearn-{job}") in log, log
        assert "3 process(es)" in log, log
        assert i == 0 or "resumed from" in log, log
    assert not os.path.exists(stage) or os.listdir(stage) == [], os.listdir(stage)
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["data"]["files"] == files and saved["data"]["val_files"] == [val]

    got = ckpt.load(ckpt.latest(str(out / "checkpoints")))["task"]["models"]["model"]
    want = ckpt.load(ckpt.latest(str(whole / "checkpoints")))["task"]["models"]["model"]
    assert all(v.dtype == torch.float64 for v in want.values())
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    assert [r["epoch"] for r in read_jsonl(str(out / "metrics.jsonl"))] == [1, 2, 3]
