"""A sweep's identity is guarded like a run's (issue 28): --resume lists the accepted changes
and refuses the others (exit 2, naming the keys) unless --force, every accepted config is
kept and named in the journal, wall_time counts every session of an interrupted trial, and
nothing writes config.yaml before every check passed. Real mpirun throughout."""
import os
import signal
import subprocess
import time

import yaml

from conftest import ENV, REPO, TESTS, mpirun, mpirun_cmd, train_args
from mpilearn.core.io import read_jsonl


def write(path, cfg):
    path.write_text(yaml.safe_dump(cfg))
    return path


def optimize(config, *extra, np_=2):
    return mpirun(np_, ["-m", "mpilearn.optimize", "--config", str(config), "--no-progress",
                        *extra], timeout=300, env={"PYTHONPATH": TESTS})


def quadratic_sweep(out, budget: int, folds: int) -> dict:
    """A random search of objectives:slow_quadratic on one block, folds in sequence."""
    return {"output": str(out),
            "search": {"searcher": "random", "budget": budget, "blocks": 1, "folds": folds,
                       "fold_mode": "sequential",
                       "objective": {"function": "objectives:slow_quadratic"},
                       "space": {"x": {"type": "real", "low": 0, "high": 1}}}}


def test_resume_refuses_changes_to_what_the_trials_are_and_keeps_every_accepted_config(tmp_path):
    out = tmp_path / "sweep"
    cfg = quadratic_sweep(out, budget=2, folds=1)
    path = write(tmp_path / "hpo.yaml", cfg)
    assert optimize(path).returncode == 0
    saved = (out / "config.yaml").read_bytes()

    refused = [({"space": {"x": {"type": "real", "low": 0, "high": 2}}}, "search.space.x.high: 1 -> 2"),
               ({"searcher": "gp"}, "search.searcher: 'random' -> 'gp'"),
               ({"folds": 2}, "search.folds: 1 -> 2"),
               ({"objective": {"function": "objectives:fragile"}}, "search.objective.function")]
    for change, named in refused:
        changed = write(tmp_path / "changed.yaml", {**cfg, "search": {**cfg["search"], **change}})
        proc = optimize(changed, "--resume")
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("mpilearn: error: --resume with a config that differs") == 1
        assert named in proc.stderr and "--force" in proc.stderr
        assert (out / "config.yaml").read_bytes() == saved  # nothing written
    assert sorted(os.listdir(out / "config-history")) == ["0001.yaml"]
    changed = write(tmp_path / "model.yaml", {**cfg, "train": {"epochs": 5}})
    proc = optimize(changed, "--resume")
    assert proc.returncode == 2 and "train.epochs: 1 -> 5" in proc.stderr

    # budget and blocks may change: listed, accepted, kept as config 2
    more = write(tmp_path / "more.yaml", {**cfg, "search": {**cfg["search"], "budget": 4, "blocks": 2}})
    proc = optimize(more, "--resume", np_=3)
    assert proc.returncode == 0, proc.stderr
    assert "resuming with a changed config: search.blocks: 1 -> 2; search.budget: 2 -> 4" in proc.stdout
    # a refused change goes through with --force, and is kept too
    forced = write(tmp_path / "forced.yaml",
                   {**cfg, "search": {**cfg["search"], "budget": 5, "blocks": 2, "searcher": "gp"}})
    proc = optimize(forced, "--resume", "--force", np_=3)
    assert proc.returncode == 0, proc.stderr
    history = sorted(os.listdir(out / "config-history"))
    assert history == ["0001.yaml", "0002.yaml", "0003.yaml"]
    kept = [yaml.safe_load(open(out / "config-history" / h))["search"] for h in history]
    assert [(s["budget"], s["searcher"]) for s in kept] == [(2, "random"), (4, "random"), (5, "gp")]
    assert yaml.safe_load(open(out / "config.yaml")) == yaml.safe_load(open(out / "config-history" / "0003.yaml"))
    events = read_jsonl(str(out / "journal.jsonl"))
    assert [e["config"] for e in events if e["event"] == "job"] == [1, 2, 3]
    assert [e["config"] for e in events if e["event"] == "started"] == [1, 1, 2, 2, 3]


def test_a_trials_wall_time_with_sequential_folds_is_theirs_summed(tmp_path):
    out = tmp_path / "sweep"
    cfg = quadratic_sweep(out, budget=1, folds=3)
    assert optimize(write(tmp_path / "hpo.yaml", cfg)).returncode == 0
    done = [e for e in read_jsonl(str(out / "journal.jsonl")) if e["event"] == "done"]
    walls = [f["wall"] for f in done[0]["folds"]]
    assert len(walls) == 3 and min(walls) >= 0.4  # each fold sleeps 0.4 s
    assert done[0]["wall"] == sum(walls)  # not the first fold's, nor the longest's


def test_wall_time_counts_every_session_of_an_interrupted_trial(toy_file, tmp_path):
    out = tmp_path / "sweep"
    cfg = {"model": f"{TESTS}/models/slow.py", "hparams": {"sleep": 0.1},
           "data": {"files": [toy_file]}, "output": str(out),
           "train": {"epochs": 1, "batch_size": 32, "checkpoint_every_steps": 1},
           "search": {"searcher": "random", "budget": 1, "blocks": 1, "folds": 1,
                      "objective": {"metric": "wall_time"},
                      "space": {"lr": {"type": "real", "low": 1e-3, "high": 1e-2}}}}
    path = write(tmp_path / "hpo.yaml", cfg)
    args = ["-m", "mpilearn.optimize", "--config", str(path), "--no-progress", "--resume", "auto"]
    job = subprocess.Popen(mpirun_cmd(2, args), cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and job.poll() is None:  # late in its one epoch
        latest = list(out.glob("trials/*/fold0/checkpoints/latest"))
        if latest and int(latest[0].read_text().strip()[-10:-3]) >= 20:
            break
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)
    output, _ = job.communicate(timeout=120)
    assert job.returncode == 75, output
    journal = str(out / "journal.jsonl")
    first = [e for e in read_jsonl(journal) if e["event"] == "interrupted"][0]["folds"][0]["wall"]

    proc = optimize(path, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    done = [e for e in read_jsonl(journal) if e["event"] == "done"]
    assert len(done) == 1
    # the second session trained the last few of 28 steps of 0.1 s: alone it is shorter than
    # the first; the trial's wall and its wall_time are the sum
    assert done[0]["wall"] > first + 0.2, (done[0]["wall"], first)
    assert abs(done[0]["value"] - done[0]["wall"]) < 1.0


def test_a_refused_train_resume_force_leaves_the_saved_config(toy_file, tmp_path):
    out = tmp_path / "run"
    base = ["--set", f"model={REPO}/models/mlp.py", "--set", f"data.files=[{toy_file}]",
            "--set", "train.batch_size=16", "--set", "train.max_steps_per_epoch=2",
            "--output", str(out)]
    assert mpirun(2, train_args(*base), timeout=120).returncode == 0
    saved = (out / "config.yaml").read_bytes()
    proc = mpirun(2, train_args(*base, "--set", "hparams.hidden=16", "--resume", "--force"),
                  timeout=120)
    assert proc.returncode == 2 and "is not a checkpoint of this model" in proc.stderr
    assert (out / "config.yaml").read_bytes() == saved
    proc = mpirun(2, train_args(*base, "--set", "train.epochs=2", "--resume"), timeout=120)
    assert proc.returncode == 0, proc.stderr  # the plain resume is not refused
