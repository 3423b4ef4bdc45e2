"""Across two "nodes" (network namespaces with their own host names, a slurmd each; see
two_nodes.py): node-local ranks, per-node device binding, mpilearn-run's host file, and the
jobs/ scripts (srun and mpirun) with ranks on both nodes."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from conftest import REPO, TESTS, mpirun, train_args
from mpilearn.core.io import read_jsonl
from mpilearn.train import checkpoint as ckpt
from slurm_cluster import missing
from test_slurm import submit
from two_nodes import NODES, TwoNodes


@pytest.fixture(scope="module")
def nodes():
    need = missing() + [t for t in ("ip", "nsenter", "unshare") if shutil.which(t) is None]
    if os.geteuid() != 0 or need:
        pytest.skip(f"*** TWO-NODE TESTS SKIPPED: need root and {', '.join(need) or 'root'} "
                    "(make slurm-packages) ***")
    cluster = TwoNodes().start()
    try:
        yield cluster
    finally:
        cluster.stop()
        assert cluster.processes() == [], "SLURM daemons left running"


def finished(cluster, tmp_path, job, timeout=300):
    info = cluster.wait(job, timeout=timeout)
    log = open(tmp_path / f"slurm-{job}.out").read()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log + cluster.logs()
    return log


def test_node_local_ranks_and_device_binding_with_srun_and_mpilearn_run(nodes, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text(f"{NODES[0]} slots=2\n{NODES[1]}:2  # both host file forms\n")
    script = tmp_path / "placement.sbatch"
    probe = os.path.join(TESTS, "scripts", "placement.py")
    script.write_text(f"#!/bin/bash\nsource {REPO}/.venv/bin/activate\n"
                      # one more try, said in the log, where a loaded machine gave no placement
                      # (CI: no srun line at all, once; the daemons' logs below say why next time)
                      f"out=$(srun --mpi=pmix python {probe}); echo \"srun exited $?\"; "
                      f"echo \"$out\"\n"
                      f"case \"$out\" in *placement*) ;; *) echo 'no placement: once more'; "
                      f"srun --mpi=pmix python {probe};; esac\n"
                      f"mpilearn-run -np 4 --hostfile {hosts} python {probe}\n")
    log = finished(nodes, tmp_path, submit(nodes, tmp_path, str(script),
                                           flags=["--nodes=2", "--ntasks-per-node=2"]))
    lines = [json.loads(l.split(" ", 1)[1]) for l in log.splitlines() if l.startswith("placement ")]
    assert len(lines) == 8, log + nodes.logs()
    assert f"-H {NODES[0]}:2,{NODES[1]}:2" in log, log  # the host file, both forms, parsed
    for launcher, group in (("srun", lines[:4]), ("mpirun", lines[4:])):
        assert [(p["rank"], p["host"], p["local_rank"]) for p in group] == [
            (0, NODES[0], 0), (1, NODES[0], 1), (2, NODES[1], 0), (3, NODES[1], 1)], group
        # each node binds its own GPUs by node-local rank: cuda:0, cuda:1 on both
        assert [p["device"] for p in group] == ["cuda:0", "cuda:1"] * 2
        assert all(p["local_size"] == 2 and p["size"] == 4 for p in group)
        assert f"launcher {launcher}, 4 process(es)" in group[0]["launch"]


def test_the_sbatch_scripts_run_across_both_nodes(nodes, toy_file, tmp_path):
    """jobs/train.sbatch (srun) and jobs/train-mpirun.sbatch resized to 2 nodes x 2 tasks
    train exactly what 4 ranks on one machine train; jobs/hpo.sbatch places a 5-task sweep
    (coordinator + 2 blocks x 2) on 3 + 2 tasks of the two nodes."""
    cfg = {"model": f"{TESTS}/models/slow64.py", "hparams": {"sleep": 0.0},
           "data": {"files": [toy_file]},
           "train": {"epochs": 1, "batch_size": 16, "deterministic": True}}
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(cfg))
    local = tmp_path / "local"
    proc = mpirun(4, train_args("--config", str(config), "--output", str(local)))
    assert proc.returncode == 0, proc.stderr
    want = ckpt.load(ckpt.latest(str(local / "checkpoints")))["task"]["models"]["model"]
    size = ["--nodes=2", "--ntasks-per-node=2"]
    # and mpirun with staging to each node's own directory (MPILEARN_STAGE must reach node 2)
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"launcher": "mpirun", "stage_to": nodes.path("nodetmp")}))
    staged = tmp_path / "staged.sbatch"
    rendered = subprocess.run([sys.executable, "-m", "mpilearn.jobs", "--config", str(config),
                               "--site", str(site)], cwd=REPO, capture_output=True, text=True)
    staged.write_text(rendered.stdout)
    for script in ("train.sbatch", "train-mpirun.sbatch", str(staged)):
        out = tmp_path / ("run-" + os.path.basename(script))
        log = finished(nodes, tmp_path, submit(nodes, tmp_path, os.path.join(REPO, "jobs", script),
                                               str(config), str(out), flags=size))
        assert "4 process(es)" in log and "2 rank(s) on this node" in log, log
        if script == str(staged):
            assert "-x MPILEARN_STAGE" in staged.read_text()
            for node in NODES:  # staged on each node, removed at the job's end
                assert f"staged 1 file(s), 0.0 MiB, to {nodes.path('nodetmp')}" in log, log
                assert f" on {node}\n" in log, log
                left = [n for n in os.listdir(nodes.path(f"tmp-{node}")) if n.startswith("mpilearn-")]
                assert left == [], left
        got = ckpt.load(ckpt.latest(str(out / "checkpoints")))["task"]["models"]["model"]
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)

    base = yaml.safe_load(open(os.path.join(REPO, "jobs", "hpo-mlp.yaml")))
    sweep = {**cfg, "model": f"{TESTS}/models/slow.py", "train": {"epochs": 1, "batch_size": 128},
             "search": {**base["search"], "budget": 2}}
    path = tmp_path / "hpo.yaml"
    path.write_text(yaml.safe_dump(sweep))
    out = tmp_path / "sweep"
    job = submit(nodes, tmp_path, os.path.join(REPO, "jobs", "hpo.sbatch"), str(path), str(out),
                 flags=["--nodes=2", "--ntasks-per-node=3"])
    log = finished(nodes, tmp_path, job)
    # the header asks for the sweep's 5 tasks in all (--ntasks), at most 3 per node: the host
    # file placed 3 + 2 and the allocation holds no idle task (before: 6, one left idle)
    assert "5 process(es)" in log and "3 rank(s) on this node" in log, log
    assert "of the allocation's" not in log, log
    assert not os.path.exists(out / f"hosts-{job}")
    assert len([r for r in read_jsonl(str(out / "journal.jsonl")) if r["event"] == "done"]) == 2


def test_a_cancelled_job_leaves_no_stage_on_any_node(nodes, toy_file, tmp_path):
    """scancel of a job that staged its data on both nodes: no stage remains on either (the
    node-local rank 0 removes its node's; a cancelled job cannot srun its clean-up), and the
    stages a job killed with its nodes left are removed by the next job's staging."""
    from test_slurm import wait_for

    for node in NODES:  # what a job that died with its nodes left behind
        os.makedirs(nodes.path(f"tmp-{node}", "mpilearn-9999", "data"))
    cfg = {"model": f"{TESTS}/models/slow.py", "hparams": {"sleep": 0.2},
           "data": {"files": [toy_file]},
           "train": {"epochs": 20, "batch_size": 16, "max_steps_per_epoch": 10}}
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(cfg))
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"stage_to": nodes.path("nodetmp")}))
    script = tmp_path / "staged.sbatch"
    script.write_text(subprocess.run([sys.executable, "-m", "mpilearn.jobs", "--config",
                                      str(config), "--site", str(site)], cwd=REPO,
                                     capture_output=True, text=True, check=True).stdout)
    out = tmp_path / "run"
    job = submit(nodes, tmp_path, str(script), str(config), str(out),
                 flags=["--nodes=2", "--ntasks-per-node=2"])
    wait_for(out / "metrics.jsonl")
    nodes.run(["scancel", job])
    info = nodes.wait(job)
    log = open(tmp_path / f"slurm-{job}.out").read()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", log
    assert log.count(f"mpilearn: job {job} was cancelled") == 1, log
    for node in NODES:
        assert f"removed {nodes.path('nodetmp', 'mpilearn-9999')} on {node}," in log, log
        left = [n for n in os.listdir(nodes.path(f"tmp-{node}")) if n.startswith("mpilearn-")]
        assert left == [], (node, left, log)


def test_losing_every_rank_of_one_node_an_elastic_job_finishes_equal_to_the_replay(
        nodes, toy_file, tmp_path):
    """An elastic training rendered for mpirun (--with-ft ulfm), 2 nodes x 2 ranks; both ranks of
    the second node die by SIGKILL at step 21: the first node's two ranks finish, every event
    trained once per epoch, with the weights of the replay (stopped at step 20 at 4 ranks,
    resumed at 2)."""
    cfg = {"model": f"{TESTS}/models/elastic_mlp.py", "data": {"files": [toy_file],
                                                               "val_fraction": 0.0625},
           "train": {"epochs": 2, "batch_size": 4, "deterministic": True}}
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(cfg))
    replay = tmp_path / "replay"
    stop = mpirun(4, train_args("--config", str(config), "--output", str(replay)),
                  env={"MPILEARN_TEST_STOP": "20"})
    assert stop.returncode == 75, stop.stderr
    resumed = mpirun(2, train_args("--config", str(config), "--output", str(replay), "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"launcher": "mpirun", "mpirun_args": "-x MPILEARN_TEST_KILL"}))
    script = tmp_path / "elastic.sbatch"
    script.write_text(subprocess.run(
        [sys.executable, "-m", "mpilearn.jobs", "--config", str(config), "--site", str(site),
         "--set", "train.elastic.min_ranks=2"], cwd=REPO, capture_output=True, text=True,
        check=True).stdout)
    out = tmp_path / "run"
    env = {"MPILEARN_TEST_KILL": "2,3:20"}
    log = finished(nodes, tmp_path, submit(nodes, tmp_path, str(script), str(config), str(out),
                                           flags=["--nodes=2", "--ntasks-per-node=2"], env=env))
    assert "--with-ft ulfm" in script.read_text()
    assert "4 process(es)" in log and f"rank 2 on {NODES[1]}" in log, log
    assert f"rank 3 on {NODES[1]}" in log and "going on with 2 rank(s) from step 20" in log, log
    changes = [r["membership"] for r in read_jsonl(str(out / "metrics.jsonl")) if "membership" in r]
    assert sorted(r for c in changes for r in c["lost_ranks"]) == [2, 3], changes
    assert changes[-1]["ranks"] == 2, changes
    model = ckpt.load(ckpt.latest(str(out / "checkpoints")))["task"]["models"]["model"]
    assert int((model["seen"] == 2).sum()) == 960  # every training event once per epoch
    want = ckpt.load(ckpt.latest(str(replay / "checkpoints")))["task"]["models"]["model"]
    for k in want:
        torch.testing.assert_close(model[k], want[k], rtol=0, atol=0)
