"""Hyperparameter search: layout, spaces, searcher quality, real sweeps under mpirun."""
import csv
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
import yaml

from conftest import ENV, REPO, TESTS, mpirun, mpirun_cmd
from mpilearn.core.comm import UsageError
from mpilearn.hpo import benchmarks, layout
from mpilearn.hpo.searchers import make_searcher
from mpilearn.hpo.space import Space, apply, trial_key
from mpilearn.core.io import read_jsonl


def test_layout_is_a_pure_function_with_helpful_errors():
    r = layout.role(4, 9, 2, 2, 2, "parallel")
    assert (r.block, r.block_rank, r.fold_group, r.fold_rank) == (0, 3, 1, 1)
    assert layout.role(0, 9, 2, 2, 2, "parallel").coordinator
    assert layout.role(6, 9, 4, 2, 2, "sequential").block == 2
    with pytest.raises(UsageError, match=r"np=4 does not fit.*needs np=5; valid np for this block shape: 3, 5, 7"):
        layout.check(4, 2, 2, 1, "parallel")


def test_space_encoding_and_validation():
    space = Space.from_config({"lr": {"type": "real", "low": 1e-4, "high": 1e-1, "log": True},
                               "n": {"type": "int", "low": 2, "high": 5},
                               "opt": {"type": "categorical", "choices": ["adam", "sgd"]}},
                              defaults={"n": 3})
    assert space.params[1].default == 3
    rng = np.random.default_rng(0)
    for _ in range(50):
        p = space.sample(rng)
        assert 1e-4 <= p["lr"] <= 1e-1 and p["n"] in (2, 3, 4, 5) and p["opt"] in ("adam", "sgd")
        assert isinstance(p["n"], int)
        back = space.decode(space.encode(p))
        assert back["n"] == p["n"] and back["opt"] == p["opt"]
        assert back["lr"] == pytest.approx(p["lr"])
    assert trial_key({"a": 1, "b": 0.5}) == trial_key({"b": 0.5, "a": 1}) != trial_key({"a": 2, "b": 0.5})
    assert apply({"w": [3, 0.1], "lr": 1}, {"w.1": 0.5, "lr": 2}) == {"w": [3, 0.5], "lr": 2}
    # a list the config leaves out starts from the model's default (a sweep of one width)
    assert apply({"lr": 1}, {"w.1": 0.5}, {"w": [3, 0.1], "lr": 1}) == {"w": [3, 0.5], "lr": 1}
    assert apply({}, {"w.2": 30.0}, {"w": None}) == {"w": {"2": 30.0}}  # overrides of a None
    with pytest.raises(UsageError, match=r"search.space.w.5: hparams.w is \[3, 0.1\] here"):
        Space.from_config({"w.5": {"type": "real", "low": 0, "high": 1}}, {"w": [3, 0.1]})
    for bad, msg in [({"x": {"type": "real", "low": 1, "high": 1}}, "empty or inverted range"),
                     ({"x": {"type": "real", "low": 2, "high": 1}}, "empty or inverted range"),
                     ({"x": {"type": "real", "low": 0, "high": 1, "log": True}}, "log range needs low > 0"),
                     ({"x": {"type": "float", "low": 0, "high": 1}}, "search.space.x.type"),
                     ({"x": {"type": "categorical", "choices": []}}, "non-empty list"),
                     # typos get a did-you-mean, as every other key does (issue 48)
                     ({"x": {"type": "rael", "low": 0, "high": 1}},
                      r"search.space.x.type is 'rael' \(did you mean 'real'\?\); choose one of"),
                     ({"x": {"type": "real", "low": 0, "hgih": 1}},
                      r"search.space.x: unknown field\(s\) hgih \(did you mean 'high'\?\)")]:
        with pytest.raises(UsageError, match=msg):
            Space.from_config(bad)


def regret_after(name, func, best, searcher, seed, n=30, **opts):
    space = Space.from_config(benchmarks.space(name))
    s = make_searcher(searcher, space, seed, **opts)
    found = np.inf
    for _ in range(n):
        p = s.ask()
        v = func(p)
        s.tell(p, v)
        found = min(found, v)
    return found - best


@pytest.mark.parametrize("name,func,best", [
    ("branin", benchmarks.branin, benchmarks.BRANIN_MIN),
    ("hartmann6", benchmarks.hartmann6, benchmarks.HARTMANN6_MIN),
])
def test_gp_and_evolution_beat_random(name, func, best):
    seeds = range(5)
    rand = np.median([regret_after(name, func, best, "random", s) for s in seeds])
    gp = np.median([regret_after(name, func, best, "gp", s, n_initial=8) for s in seeds])
    evo = np.median([regret_after(name, func, best, "evolution", s, population=8) for s in seeds])
    assert gp < rand, (gp, rand)
    assert evo < rand, (evo, rand)


def sweep_config(tmp_path, **search):
    cfg = {"output": str(tmp_path / "sweep"),
           "search": {"searcher": "random", "budget": 6, "blocks": 2, "folds": 1, **search}}
    path = tmp_path / "hpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def optimize(np_, config, *extra, timeout=600):
    return mpirun(np_, ["-m", "mpilearn.optimize", "--config", str(config), "--no-progress", *extra],
                  timeout=timeout, env={"PYTHONPATH": TESTS})


def test_failures_are_recorded_and_the_sweep_goes_on(tmp_path):
    cfg = sweep_config(tmp_path, budget=12, objective={"function": "objectives:fragile"},
                       space={"x": {"type": "real", "low": 0, "high": 1}})
    proc = optimize(3, cfg)
    assert proc.returncode == 0, proc.stderr
    rows = [r for r in read_jsonl(str(tmp_path / "sweep" / "journal.jsonl")) if r["event"] in ("done", "failed")]
    assert len(rows) == 12
    failed = [r for r in rows if r["event"] == "failed"]
    reasons = " ".join(r["reason"] for r in failed)
    assert "builder exploded" in reasons and "objective is nan" in reasons
    assert any(r["event"] == "done" for r in rows)


def test_kill9_mid_sweep_then_resume(tmp_path):
    cfg = sweep_config(tmp_path, budget=10, searcher="gp", options={"n_initial": 3},
                       objective={"function": "objectives:slow_quadratic"},
                       space={"x": {"type": "real", "low": 0, "high": 1}})
    journal = tmp_path / "sweep" / "journal.jsonl"
    args = ["-m", "mpilearn.optimize", "--config", str(cfg), "--no-progress"]
    job = subprocess.Popen(mpirun_cmd(3, args), cwd=REPO, env={**ENV, "PYTHONPATH": TESTS},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if journal.exists() and sum(r["event"] == "done" for r in read_jsonl(str(journal))) >= 3:
            break
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    before = read_jsonl(str(journal))
    done_before = {r["key"] for r in before if r["event"] == "done"}
    assert 3 <= len(done_before) < 10
    proc = optimize(3, cfg, "--resume")
    assert proc.returncode == 0, proc.stderr
    events = read_jsonl(str(journal))
    finished = [r for r in events if r["event"] in ("done", "failed")]
    keys = [r["key"] for r in finished]
    assert len(keys) == 10 and len(set(keys)) == 10  # exactly the budget, nothing twice
    assert done_before <= set(keys)
    for key in done_before:  # a finished trial never started again
        assert sum(r["event"] == "started" and r["key"] == key for r in events) == 1


def test_a_block_with_one_trial_more_than_the_other_finishes(toy_file, tmp_path):
    """Budget 3 on 2 blocks: block 0 trains the third trial alone after block 1 has left.
    Each trial's device choice was a collective over every worker on the node, so the lone
    trial waited for ever for the block that had gone."""
    cfg = {"model": f"{REPO}/models/mlp.py", "data": {"files": [toy_file]},
           "train": {"epochs": 1, "batch_size": 32}, "output": str(tmp_path / "sweep"),
           "search": {"searcher": "random", "budget": 3, "blocks": 2, "folds": 1,
                      "objective": {"metric": "val_loss", "mode": "best"},
                      "space": {"lr": {"type": "real", "low": 1e-3, "high": 0.1, "log": True}}}}
    path = tmp_path / "hpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = optimize(3, path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = [r for r in read_jsonl(str(tmp_path / "sweep" / "journal.jsonl")) if r["event"] == "done"]
    assert len(done) == 3


def test_real_sweep_of_the_supervised_model(toy_file, tmp_path):
    cfg = {"model": f"{REPO}/models/mlp.py", "data": {"files": [toy_file]},
           "train": {"epochs": 2, "batch_size": 32, "log": ["jsonl", "tensorboard"]},
           "output": str(tmp_path / "sweep"),
           "search": {"searcher": "gp", "budget": 4, "blocks": 2, "folds": 2, "ranks_per_fold": 1,
                      "options": {"n_initial": 2},
                      "objective": {"metric": "val_loss", "mode": "best"},
                      "space": {"lr": {"type": "real", "low": 1e-3, "high": 0.1, "log": True},
                                "hidden": {"type": "int", "low": 4, "high": 32},
                                "optimizer": {"type": "categorical", "choices": ["adam", "sgd"]}}}}
    path = tmp_path / "hpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = optimize(5, path)
    assert proc.returncode == 0, proc.stderr
    done = [r for r in read_jsonl(str(tmp_path / "sweep" / "journal.jsonl")) if r["event"] == "done"]
    assert len(done) == 4
    for r in done:
        assert len(r["fold_values"]) == 2 and r["value"] == pytest.approx(np.mean(r["fold_values"]))
        for fold in (0, 1):  # each fold its own run directory, its point in TensorBoard's HParams
            folder = tmp_path / "sweep" / "trials" / r["key"] / f"fold{fold}"
            assert (folder / "metrics.jsonl").exists()
            from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

            from tensorboard.plugins.hparams import plugin_data_pb2

            board = EventAccumulator(str(folder / "tensorboard")).Reload()
            start = board.PluginTagToContent("hparams")["_hparams_/session_start_info"]
            info = plugin_data_pb2.HParamsPluginData.FromString(start).session_start_info
            assert info.hparams["lr"].number_value == pytest.approx(r["params"]["lr"])
            assert info.hparams["optimizer"].string_value == r["params"]["optimizer"]
            assert "hparam/val_loss" in board.Tags()["scalars"]
    proc = mpirun(1, ["-m", "mpilearn.report", str(tmp_path / "sweep")])
    assert proc.returncode == 0, proc.stderr
    report = tmp_path / "sweep" / "report"
    rows = list(csv.DictReader(open(report / "trials.csv")))
    assert len(rows) == 4 and {"lr", "hidden", "optimizer", "value"} <= set(rows[0])
    best = json.load(open(report / "best.json"))
    assert best["best"]["value"] == min(r["value"] for r in done)
    for png in ("convergence.png", "parameters.png", "utilisation.png"):
        assert (report / png).stat().st_size > 5000


@pytest.mark.smoke  # make check: the np=2 run of optimize
def test_short_sweep_of_the_small_3dgan_on_the_physics_score(tmp_path):
    from mpilearn.calo.simulate import simulate

    simulate(str(tmp_path / "showers"), 120, "angle", (100, 200), 4, 120, progress=False)
    cfg = {"model": f"{REPO}/models/gan3d.py", "hparams": {"preset": "small"},
           "data": {"files": [str(tmp_path / "showers" / "*.h5")]},
           "train": {"epochs": 1, "batch_size": 8, "max_steps_per_epoch": 2, "validate_every": 1,
                     "physics_events": 24},
           "output": str(tmp_path / "sweep"),
           "search": {"searcher": "random", "budget": 2, "blocks": 1, "folds": 1,
                      "objective": {"metric": "score"},
                      "space": {"lr": {"type": "real", "low": 1e-4, "high": 1e-2, "log": True},
                                "loss_weights.2": {"type": "real", "low": 5, "high": 50}}}}
    path = tmp_path / "hpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = optimize(2, path)
    assert proc.returncode == 0, proc.stderr
    done = [r for r in read_jsonl(str(tmp_path / "sweep" / "journal.jsonl")) if r["event"] == "done"]
    assert len(done) == 2 and all(np.isfinite(r["value"]) and r["value"] > 0 for r in done)


def test_trial_time_limit(toy_file, tmp_path):
    cfg = {"model": f"{TESTS}/models/slow.py", "hparams": {"sleep": 0.2},
           "data": {"files": [toy_file]}, "train": {"epochs": 5, "batch_size": 16},
           "output": str(tmp_path / "sweep"),
           "search": {"searcher": "random", "budget": 2, "blocks": 1, "folds": 1, "trial_timeout": 1.0,
                      "space": {"lr": {"type": "real", "low": 1e-3, "high": 1e-2}}}}
    path = tmp_path / "hpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = optimize(2, path)
    assert proc.returncode == 4, proc.stderr  # no trial succeeded: a failed sweep
    failed = [r for r in read_jsonl(str(tmp_path / "sweep" / "journal.jsonl")) if r["event"] == "failed"]
    assert len(failed) == 2 and all("time limit" in r["reason"] for r in failed)
    out, key = tmp_path / "sweep", failed[-1]["key"]
    assert [l for l in proc.stderr.splitlines() if l.startswith("mpilearn")][-1] == (
        "mpilearn: sweep failed: no trial succeeded: 2 of 2 failed with TrainingStopped: the "
        f"trial ran past its time limit; the last of them, trial {key}, has its traceback in "
        f"{out}/journal.jsonl (its 'failed' event), its output in the lines marked [trial {key} "
        f"fold N] and its runs in {out}/trials/{key}"), proc.stderr


@pytest.mark.parametrize("np_,search,message", [
    (3, {"space": {"x": {"type": "real", "low": 2, "high": 1}}}, "empty or inverted range"),
    (3, {"searcher": "bayes"}, "'search.searcher' is 'bayes'"),
    (4, {}, "np=4 does not fit the layout"),
    (3, {"objective": {"metric": "val_accuracy"}}, "'val_accuracy' is never logged"),
    (3, {"searcher": "gp", "options": {"n_inital": 3}},
     "search.options.n_inital: not an option of the gp searcher (did you mean 'n_initial'?)"),
    (3, {"searcher": "gp", "options": {"acq_func": "UCB"}}, "search.options.acq_func is 'UCB'"),
    (3, {"space": {"hiden": {"type": "int", "low": 8, "high": 64}}},
     "search.space.hiden: the model has no hyperparameter 'hiden' (did you mean 'hidden'?)"),
    (3, {"model_hparams": {"optimizer": "adamw"}},
     "hparams.optimizer is 'adamw': not one of 'adam', 'sgd'; did you mean 'adam'?"),
    (3, {"space": {"momentum": {"type": "real", "low": 0.5, "high": 1.5}}},
     "search.space.momentum: hparams.momentum is 1.5: must be a number in [0, 1]"),
    (3, {"model_hparams": {"hiden": 16}},
     "hparams.hiden: the model " + f"{REPO}/models/mlp.py" + " has no hyperparameter 'hiden' "
     "(did you mean 'hidden'?)"),
    (3, {"objective": {"metric": ["val_loss", "wall_time"]}},
     "search.objective has 2 objectives; the random searcher handles one"),
    (3, {"searcher": "evolution", "pruner": "median",
         "objective": {"metric": ["val_loss", "wall_time"]}},
     "search.pruner median judges one objective; this sweep has 2"),
    (3, {"objective": {"metric": "val_loss", "direction": "maximise"}},
     "search.objective.direction has 'maximise'; choose minimize or maximize"),
    (3, {"pruner": "asha", "pruner_options": {"reduction": 3}},
     "search.pruner_options.reduction: not an option of the asha pruner (did you mean "
     "'reduction_factor'?)"),
    (3, {"enqueue": [{"lr": 0.5}]}, "search.enqueue[0].lr is 0.5: outside the space (real in "
                                    "[0.001, 0.01])"),
    (3, {"warm_start": ["no/such/sweep"]}, "search.warm_start: no/such/sweep/journal.jsonl not found"),
    (3, {"data_test_files": ["x.h5"]}, "data.test_files in a sweep: give them as search.test_files"),
])
def test_bad_sweep_input(toy_file, tmp_path, np_, search, message):
    base = {"searcher": "random", "budget": 2, "blocks": 2, "folds": 1,
            "space": {"lr": {"type": "real", "low": 1e-3, "high": 1e-2}}}
    hparams = search.pop("model_hparams", {})
    data = {"files": [toy_file], "test_files": search.pop("data_test_files", [])}
    cfg = {"model": f"{REPO}/models/mlp.py", "data": data, "hparams": hparams,
           "output": str(tmp_path / "sweep"), "search": {**base, **search}}
    path = tmp_path / "hpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = optimize(np_, path)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and proc.stderr.count("mpilearn: error:") == 1
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "sweep" / "journal.jsonl").exists()


def test_stop_signal_records_in_flight_trials_and_resume_auto_finishes(toy_file, tmp_path):
    cfg = {"model": f"{TESTS}/models/slow.py", "hparams": {"sleep": 0.03},
           "data": {"files": [toy_file]}, "train": {"epochs": 2, "batch_size": 32},
           "output": str(tmp_path / "sweep"),
           "search": {"searcher": "random", "budget": 4, "blocks": 2, "folds": 1,
                      "space": {"lr": {"type": "real", "low": 1e-3, "high": 1e-2}}}}
    path = tmp_path / "hpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    args = ["-m", "mpilearn.optimize", "--config", str(path), "--no-progress", "--resume", "auto"]
    job = subprocess.Popen(mpirun_cmd(3, args), cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    trials = tmp_path / "sweep" / "trials"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(trials.glob("*/fold0/metrics.jsonl")):
        time.sleep(0.05)  # wait until a trial is half-way (its first epoch logged)
    job.send_signal(signal.SIGUSR1)
    stdout, stderr = job.communicate(timeout=120)
    assert job.returncode == 75, stderr
    assert "sweep stopped" in stdout
    # one line per sweep, not one per fold (issue 48)
    assert stdout.count(f"mpilearn: no sweep in {tmp_path / 'sweep'}; starting one") == 1, stdout
    assert "starting fresh" not in stdout
    stop_lines = [l for l in stdout.splitlines() if "stopped by" in l]  # one, for every fold
    assert len(stop_lines) == 1 and stop_lines[0].startswith("mpilearn: stopped by SIGUSR1; "
                                                             "checkpoint "), stdout
    journal = str(tmp_path / "sweep" / "journal.jsonl")
    interrupted = {r["key"] for r in read_jsonl(journal) if r["event"] == "interrupted"}
    finished = {r["key"] for r in read_jsonl(journal) if r["event"] in ("done", "failed")}
    assert interrupted and not interrupted & finished
    half_done = [k for k in interrupted if (trials / k / "fold0" / "metrics.jsonl").exists()]
    assert half_done

    proc = optimize(3, path, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    assert "starting fresh" not in proc.stdout and "starting one" not in proc.stdout
    events = read_jsonl(journal)
    done = [r["key"] for r in events if r["event"] == "done"]
    assert len(done) == 4 and len(set(done)) == 4 and interrupted <= set(done)
    for key in half_done:  # the interrupted fold continued from its checkpoint: no epoch twice
        epochs = [r["epoch"] for r in read_jsonl(str(trials / key / "fold0" / "metrics.jsonl"))]
        assert epochs == [1, 2], epochs
    again = optimize(3, path, "--resume")  # strict resume of a finished sweep: nothing to do
    assert again.returncode == 0 and "sweep finished: 4 trials" in again.stdout


def test_sweep_blocks_train_with_downpour_and_the_fold_leader_as_master(toy_file, tmp_path):
    cfg = {"model": f"{REPO}/models/mlp.py", "data": {"files": [toy_file]},
           "train": {"epochs": 2, "batch_size": 32, "algorithm": "downpour"},
           "output": str(tmp_path / "sweep"),
           "search": {"searcher": "random", "budget": 2, "blocks": 1, "folds": 1, "ranks_per_fold": 2,
                      "space": {"lr": {"type": "real", "low": 1e-3, "high": 1e-2, "log": True}}}}
    path = tmp_path / "hpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = optimize(3, path)
    assert proc.returncode == 0, proc.stderr
    done = [r for r in read_jsonl(str(tmp_path / "sweep" / "journal.jsonl")) if r["event"] == "done"]
    assert len(done) == 2
    for r in done:  # one worker per fold: rank 0 of the fold's communicator was its master
        fold = read_jsonl(str(tmp_path / "sweep" / "trials" / r["key"] / "fold0" / "metrics.jsonl"))
        assert all(len(e["async"]["steps_per_worker"]) == 1 for e in fold)
