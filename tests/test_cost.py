"""What a run and a sweep cost: device-hours (ranks x wall seconds) in metrics.jsonl and the
sweep's journal, summed by python -m mpilearn.report, in money with --price or the site's."""
import csv
import json
import re

import pytest
import yaml

from conftest import REPO, mpirun, train_args
from mpilearn.core.io import read_jsonl


def numbers(line):
    return [float(x) for x in re.findall(r"\d+(?:\.\d+)?(?:e-?\d+)?", line)]


def test_a_runs_epochs_record_device_hours_and_report_prices_them(toy_file, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "model": f"{REPO}/models/mlp.py", "data": {"files": [toy_file]},
        "train": {"epochs": 2, "batch_size": 16, "max_steps_per_epoch": 3}}))
    run = tmp_path / "run"
    proc = mpirun(2, train_args("--config", str(config), "--output", str(run)))
    assert proc.returncode == 0, proc.stderr
    epochs = [r for r in read_jsonl(str(run / "metrics.jsonl")) if "epoch" in r]
    assert len(epochs) == 2
    for r in epochs:
        assert r["device"] == "cpu" and r["ranks"] == 2 and r["wall_s"] > 0
        assert r["device_hours"] == pytest.approx(2 * r["wall_s"] / 3600, rel=1e-3)
        assert r["wall_s"] >= r["time"]["seconds"]  # training plus validation
    total = sum(r["device_hours"] for r in epochs)
    proc = mpirun(1, ["-m", "mpilearn.report", str(run), "--price", "2.5"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    per_epoch = next(l for l in lines if "per epoch" in l)
    assert "CPU-rank-hours over 2 epoch(s)" in per_epoch
    assert numbers(per_epoch.split("=")[1])[0] == pytest.approx(total / 2 * 2.5, rel=1e-3)
    line = next(l for l in lines if "total" in l)
    assert numbers(line)[0] == pytest.approx(total, rel=1e-3)
    assert numbers(line.split("=")[1])[0] == pytest.approx(total * 2.5, rel=1e-3)
    # the price must make sense
    proc = mpirun(1, ["-m", "mpilearn.report", str(run), "--price", "-1"])
    assert proc.returncode == 2 and "--price must be 0 or more" in proc.stderr


def test_a_sweeps_journal_records_device_hours_and_report_sums_them(toy_file, tmp_path):
    cfg = {"model": f"{REPO}/models/mlp.py", "data": {"files": [toy_file]},
           "train": {"epochs": 1, "batch_size": 16, "max_steps_per_epoch": 2},
           "output": str(tmp_path / "sweep"),
           "search": {"searcher": "random", "budget": 4, "blocks": 2, "folds": 1,
                      "ranks_per_fold": 1, "objective": {"metric": "val_loss", "mode": "best"},
                      "space": {"lr": {"type": "real", "low": 1e-3, "high": 0.1, "log": True}}}}
    path = tmp_path / "hpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = mpirun(3, ["-m", "mpilearn.optimize", "--config", str(path), "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    done = [r for r in read_jsonl(str(tmp_path / "sweep" / "journal.jsonl"))
            if r["event"] == "done"]
    assert len(done) == 4
    for r in done:
        assert r["device"] == "cpu"
        assert r["device_hours"] == pytest.approx(
            sum(f["ranks"] * f["wall"] for f in r["folds"]) / 3600)
        assert r["device_hours"] > 0
    total = sum(r["device_hours"] for r in done)
    site = tmp_path / "site.yaml"
    site.write_text("price: 3.0\n")
    proc = mpirun(1, ["-m", "mpilearn.report", str(tmp_path / "sweep"), "--site", str(site)])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    line = next(l for l in out.splitlines() if "cost: total" in l)
    assert numbers(line)[0] == pytest.approx(total, rel=1e-3)
    assert numbers(line.split("=")[1])[0] == pytest.approx(total * 3.0, rel=1e-3)
    assert "per trial (4 trial(s))" in out and "per epoch (4 epoch(s))" in out
    report = tmp_path / "sweep" / "report"
    # no pruner, no intermediate values: said, not drawn as an empty plot (issue 48)
    assert "intermediate.png: not drawn: no intermediate values (no pruner)" in out
    assert not (report / "intermediate.png").exists()
    summary = json.load(open(report / "best.json"))
    best = summary["best"]
    to_best = summary["cost"]["to_best"]
    assert to_best["trial"] == best["trial"]
    finish = {r["key"]: r["time"] for r in done}
    want = sum(r["device_hours"] for r in done if r["time"] <= finish[best["key"]])
    assert to_best["device_hours"] == pytest.approx(want)
    assert to_best["cost"] == pytest.approx(want * 3.0)
    assert f"reaching the best trial's quality (trial {best['trial']})" in out
    rows = list(csv.DictReader(open(report / "trials.csv")))
    assert sorted(float(r["device_hours"]) for r in rows) == pytest.approx(
        sorted(r["device_hours"] for r in done))
