"""A sweep's final model: python -m mpilearn.refit trains the best trial on all training data
under mpirun (np=2), scores the test files once, and the report names it."""
import json
import math
import os
import subprocess
import sys

import yaml

from conftest import ENV, REPO, mpirun
from mpilearn.hpo.journal import Journal


def test_refit_of_the_best_trial_writes_a_model_and_a_test_score(toy_files, toy_file, tmp_path):
    sweep = tmp_path / "sweep"
    cfg = {"model": f"{REPO}/models/mlp.py", "data": {"files": toy_files},
           "train": {"epochs": 1, "batch_size": 16, "early_stopping": {"patience": 2}},
           "output": str(sweep),
           "search": {"searcher": "random", "budget": 3, "blocks": 1, "folds": 2,
                      "test_files": [toy_file],
                      "space": {"lr": {"type": "real", "low": 1e-3, "high": 0.05, "log": True}}}}
    (tmp_path / "hpo.yaml").write_text(yaml.safe_dump(cfg))
    proc = mpirun(3, ["-m", "mpilearn.optimize", "--config", str(tmp_path / "hpo.yaml"),
                      "--no-progress"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    done = {k: r for k, r in Journal(str(sweep / "journal.jsonl")).replay().finished.items()
            if r["status"] == "done"}
    best = min(done, key=lambda k: done[k]["value"])

    bad = mpirun(2, ["-m", "mpilearn.optimize", "--refit", str(sweep), "--trial", "nosuchkey"],
                 timeout=120)  # the alias of python -m mpilearn.refit
    assert bad.returncode == 2 and bad.stderr.count("mpilearn: error:") == 1, bad.stderr
    assert "--trial nosuchkey is not a trial of" in bad.stderr

    proc = mpirun(2, ["-m", "mpilearn.refit", str(sweep), "--no-progress"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = sweep / "refit"
    used = yaml.safe_load(open(out / "config.yaml"))  # a normal run directory's config
    params = Journal(str(sweep / "journal.jsonl")).replay().started[best]["params"]
    assert used["hparams"]["lr"] == params["lr"] and "search" not in used
    # a validation share held out: the best epoch is chosen on events it did not train on
    assert used["data"]["val_fraction"] == 0.1 and used["data"]["test_files"] == [toy_file]
    assert used["train"]["early_stopping"]["patience"] == 2
    assert "held out: the best epoch is chosen on them" in proc.stdout
    epoch = [r for r in map(json.loads, open(out / "metrics.jsonl")) if "time" in r]
    held_out = round(1024 * 0.1)
    assert epoch[-1]["step"] == (1024 - held_out) // (16 * 2)  # no fold held out, 10 % kept
    assert epoch[-1]["val_events"] == held_out and (out / "checkpoints" / "best.pt").exists()
    assert os.path.exists(out / "models" / "model.pt")
    test = json.load(open(out / "test.json"))
    assert test["test_events"] == 1024 and math.isfinite(test["test_loss"])
    assert {"test": test} in list(map(json.loads, open(out / "metrics.jsonl")))
    assert json.load(open(sweep / "refit.json"))["key"] == best

    report = subprocess.run([sys.executable, "-m", "mpilearn.report", str(sweep)], cwd=REPO,
                            env=ENV, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    assert f"refit: {out} (trial " in report.stdout and "test_loss" in report.stdout
    summary = json.load(open(sweep / "report" / "best.json"))
    assert summary["refit"]["test"]["test_loss"] == test["test_loss"]
    # nothing held out on request: the last epoch is the model, and the refit says so
    last = mpirun(2, ["-m", "mpilearn.refit", str(sweep), "--no-progress", "--output",
                      str(tmp_path / "all"), "--set", "data.val_fraction=0"], timeout=300)
    assert last.returncode == 0, last.stderr
    assert last.stdout.count("nothing held out (data.val_fraction 0)") == 1
    assert not (tmp_path / "all" / "checkpoints" / "best.pt").exists()
