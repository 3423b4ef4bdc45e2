"""What a run and a sweep cost: device-hours (ranks x wall seconds) in metrics.jsonl and the
sweep's journal, summed by python -m mpilearn.report, in money with --price or the site's."""
import csv
import json
import re

import pytest
import yaml

from conftest import REPO, mpirun, train_args
from mpilearn.core.io import read_jsonl
from mpilearn.errors import UsageError


def numbers(line):
    return [float(x) for x in re.findall(r"\d+(?:\.\d+)?(?:e-?\d+)?", line)]


def test_a_runs_epochs_and_launches_record_device_hours_and_report_prices_them(toy_file,
                                                                                tmp_path):
    """Issue 48: the launched wall time per rank (start-up, evaluation, checkpoints, export)
    beside the epochs'; a price per device kind, with its currency; CPU ranks never at the
    GPU rate; and the run's report: its text summary and PNGs."""
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
    in_epochs = sum(r["device_hours"] for r in epochs)
    (launch,) = read_jsonl(str(run / "launches.jsonl"))
    assert launch["launch"] == 1 and launch["ranks"] == 2 and launch["exit"] == 0
    assert launch["devices"] == ["cpu", "cpu"]
    for seconds in launch["launched_s"]:  # each rank from its start: more than its epochs
        assert sum(r["wall_s"] for r in epochs) < seconds < proc.seconds
    launched = sum(launch["launched_s"]) / 3600

    # a GPU price must not touch CPU ranks
    proc = mpirun(1, ["-m", "mpilearn.report", str(run), "--gpu-hour", "100", "--cpu-hour",
                      "2.5", "--currency", "USD"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    line = next(l for l in lines if l.startswith("cost: inside epochs"))
    assert numbers(line)[0] == pytest.approx(in_epochs, rel=1e-3)
    assert "CPU-rank-hours over 2 epoch(s)" in line
    line = next(l for l in lines if l.startswith("cost: launched"))
    assert numbers(line)[0] == pytest.approx(launched, rel=1e-3)
    assert f"the epochs are {in_epochs / launched:.0%} of it" in line
    line = next(l for l in lines if l.startswith("cost: launch 1:"))  # per rank
    assert line.startswith("cost: launch 1: 2 cpu rank(s), each ") and line.endswith("(exit 0)")
    assert numbers(line.split("each")[1])[0] == pytest.approx(min(launch["launched_s"]), abs=0.06)
    line = next(l for l in lines if l.startswith("cost: total"))
    assert numbers(line)[0] == pytest.approx(launched, rel=1e-3)
    assert numbers(line.split("=")[1])[0] == pytest.approx(launched * 2.5, rel=1e-3)
    assert line.endswith("USD (2.5 USD per CPU-rank-hour)")
    # the run's report: a summary and its plots (no physics: said, not drawn)
    report = run / "report"
    assert (report / "summary.txt").read_text().splitlines() == lines[:-1]
    assert lines[-1] == f"report in {report}"
    assert any(l.startswith("val_loss: last ") for l in lines)
    assert any(l.startswith("throughput: ") for l in lines)
    for png in ("losses.png", "throughput.png", "cost.png"):
        assert (report / png).stat().st_size > 5000
    assert "physics.png: not drawn: no metric with a floor" in proc.stdout
    assert json.load(open(report / "summary.json"))["cost"]["launched"]["cpu"] == \
        pytest.approx(launched)


def test_prices_are_per_device_kind_and_make_sense(tmp_path):
    from mpilearn.hpo.cost import Price, price_from_site
    from mpilearn.hpo.report import main

    assert price_from_site({"gpu_hour": 2.5, "cpu_hour": 0.05, "currency": "USD"}) == \
        Price(2.5, 0.05, "USD")
    assert price_from_site(3.0) == Price(gpu_hour=3.0)  # the old number: GPU-hours only
    assert Price(gpu_hour=3.0).money({"cpu": 1.0}) is None  # no price for CPU ranks
    assert Price(2.0, 0.5).money({"gpu": 1.0, "cpu": 2.0}) == pytest.approx(3.0)
    for bad, message in [({"gpu_hour": -1, "currency": "USD"}, "'price.gpu_hour' must be 0 or more"),
                         ({"cpu_hours": 1}, "did you mean 'price.cpu_hour'?"),
                         ({"gpu_hour": "2"}, "'price.gpu_hour' must be a number, got '2'"),
                         ({"gpu_hour": 2}, "'price.currency' is missing")]:
        with pytest.raises(UsageError, match=re.escape(message)):
            price_from_site(bad)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    assert main([str(run), "--cpu-hour", "-1"]) == 2
    assert main([str(run), "--price", "2.5"]) == 2  # one number for both kinds: refused


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
    # the job's ranks from their start to their end: the coordinator and the waits too
    events = read_jsonl(str(tmp_path / "sweep" / "journal.jsonl"))
    (job,) = [e for e in events if e["event"] == "job"]
    (end,) = [e for e in events if e["event"] == "job_end"]
    assert job["ranks"] == 3 and len(job["startup_s"]) == 3
    assert end["devices"] == ["cpu"] * 3
    assert all(a < b < proc.seconds for a, b in zip(job["startup_s"], end["launched_s"]))
    launched = sum(end["launched_s"]) / 3600
    assert launched > total
    site = tmp_path / "site.yaml"
    site.write_text("price: {gpu_hour: 100, cpu_hour: 3.0, currency: EUR}\n")
    proc = mpirun(1, ["-m", "mpilearn.report", str(tmp_path / "sweep"), "--site", str(site)])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    line = next(l for l in out.splitlines() if l.startswith("cost: trials"))
    assert numbers(line)[:2] == pytest.approx([total, launched], rel=1e-3)
    line = next(l for l in out.splitlines() if "cost: total" in l)
    assert numbers(line)[0] == pytest.approx(launched, rel=1e-3)
    assert numbers(line.split("=")[1])[0] == pytest.approx(launched * 3.0, rel=1e-3)
    assert line.endswith("EUR (3 EUR per CPU-rank-hour)")  # never the GPU rate
    assert "per trial (4 trial(s), " in out and "per epoch (4 epoch(s))" in out
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
    assert sorted(float(r["cost"]) for r in rows) == pytest.approx(
        sorted(3.0 * r["device_hours"] for r in done))


def test_gpu_ranks_pay_the_gpu_rate_and_a_killed_sweep_job_counts_to_its_last_event(tmp_path):
    """The kinds apart (no GPU on this machine: the records a GPU run writes), and a sweep job
    killed before its job_end: its coordinator a CPU rank, its blocks its trials' kind."""
    from mpilearn.hpo.cost import Price, run_lines, run_summary, sweep_launched

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(
        {"epoch": 1, "time": {}, "device": "gpu", "ranks": 2, "wall_s": 1800.0,
         "device_hours": 1.0}) + "\n")
    (run / "launches.jsonl").write_text(json.dumps(
        {"launch": 1, "ranks": 2, "devices": ["gpu", "gpu"], "launched_s": [3600.0, 3600.0],
         "exit": 0}) + "\n")
    price = Price(gpu_hour=2.5, cpu_hour=0.05, currency="USD")
    summary = run_summary(str(run), price)
    assert summary["launched"] == {"gpu": 2.0} and summary["cost"] == pytest.approx(5.0)
    assert run_lines(summary, price)[-1] == \
        "cost: total 2 GPU-hours = 5 USD (2.5 USD per GPU-hour)"
    events = [{"event": "job", "time": 100.0, "ranks": 3, "startup_s": [10.0, 20.0, 20.0]},
              {"event": "done", "time": 1900.0, "key": "a"}]
    hours = sweep_launched(events, "gpu")
    assert hours == pytest.approx({"cpu": 1810 / 3600, "gpu": 2 * 1820 / 3600})
    assert price.money(hours) == pytest.approx(1810 / 3600 * 0.05 + 2 * 1820 / 3600 * 2.5)
