"""A sweep under real ``mpirun --with-ft ulfm`` (``search.elastic``) and a real ``kill -9``:
a lost block rank costs one trial, never the sweep; a lost coordinator ends it with 75, and
``--resume`` finishes it from the journal."""
import csv
import json
import os
import signal
import subprocess
import sys
import time

import yaml

from conftest import ENV, REPO, TESTS, rank_pid
from mpilearn.core.io import read_jsonl

BUDGET = 3
KILL_AT = 30  # steps of the victim's first fold before it dies (checkpoints every 10)


def sweep(tmp_path, toy_file, *extra, env=None, wait=True, min_np=False):
    """The sweep on np=5 under ``mpirun --with-ft ulfm`` with ``search.elastic: true``, or
    (``min_np``) under ``mpilearn-run --min-np 3``, which adds both."""
    cfg = {"model": f"{TESTS}/models/armed_slow.py", "output": str(tmp_path / "sweep"),
           "data": {"files": [toy_file]}, "hparams": {"sleep": 0.02},
           "train": {"epochs": 1, "batch_size": 4, "checkpoint_every_steps": 10},
           "search": {"searcher": "random", "budget": BUDGET, "blocks": 2, "folds": 2,
                      "fold_mode": "sequential", "ranks_per_fold": 2, "elastic": not min_np,
                      "space": {"lr": {"type": "real", "low": 0.001, "high": 0.01}}}}
    path = tmp_path / "hpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    launch = [sys.executable, "-m", "mpilearn.run", "-np", "5", "--min-np", "3"] if min_np \
        else ["mpirun", "--with-ft", "ulfm", "-np", "5", "--oversubscribe",
              *[a for k in env or {} for a in ("-x", k)]]
    cmd = [*launch, sys.executable, "-m", "mpilearn.optimize", "--config", str(path),
           "--no-progress", *extra]
    run = subprocess.run if wait else subprocess.Popen
    kw = {"capture_output": True, "timeout": 240} if wait else {
        "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "start_new_session": True}
    return run(cmd, text=True, cwd=REPO, env={**ENV, **(env or {})}, **kw)


def test_a_lost_block_rank_costs_one_trial_never_the_sweep(tmp_path, toy_file):
    start = time.monotonic()
    proc = sweep(tmp_path, toy_file, env={"MPILEARN_TEST_KILL": f"1:{KILL_AT}"},  # block 0's
                 min_np=True)                                                 # leader
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " --with-ft ulfm " in proc.stderr.splitlines()[0]  # mpilearn-run's command line
    out = tmp_path / "sweep"
    events = read_jsonl(str(out / "journal.jsonl"))
    done = [e["key"] for e in events if e["event"] == "done"]
    assert len(done) == BUDGET and len(set(done)) == BUDGET  # exactly the budget, each once
    lost = [e for e in events if e["event"] == "block_lost"]
    assert len(lost) == 1 and lost[0]["block"] == 0
    assert lost[0]["reason"].startswith("rank 1 on host ") and lost[0]["reason"].endswith(" lost")
    [stopped] = [e for e in events if e["event"] == "interrupted"]
    assert stopped["block"] == 0 and stopped["reason"] == lost[0]["reason"]
    assert proc.stdout.count("mpilearn: block 0: rank 1 on host ") == 1, proc.stdout
    assert "the sweep goes on with 1 block(s)" in proc.stdout
    started = [e for e in events if e["event"] == "started"]
    victim = stopped["key"]
    again = [e for e in started if e["key"] == victim and e.get("requeued")]
    assert len(again) == 1 and again[0]["block"] == 1  # runs again, on the other block
    # ... from its fold's checkpoint: fold 0 resumed at step KILL_AT, not from the start
    assert f"[trial {victim} fold 0] mpilearn: resumed from" in proc.stdout
    assert f"ckpt-e0000-s{KILL_AT:07d}.pt" in proc.stdout
    # the other block's trial in flight at the loss never restarted: started once, each
    # fold's one epoch at its 64 steps (512 events, global batch 8), never resumed
    [other] = [e["key"] for e in started if e["block"] == 1 and e["key"] != victim
               and events.index(e) < events.index(stopped)]
    assert sum(e["key"] == other for e in started) == 1
    for fold in (0, 1):
        records = read_jsonl(str(out / "trials" / other / f"fold{fold}" / "metrics.jsonl"))
        assert [(r["epoch"], r["step"]) for r in records if "time" in r] == [(1, 64)]
        assert not [r for r in records if "membership" in r or "stopped" in r]
        assert f"[trial {other} fold {fold}] mpilearn: resumed from" not in proc.stdout
    # the report marks the lost block and the requeued trial (text, best.json, trials.csv)
    report = subprocess.run([sys.executable, "-m", "mpilearn.report", str(out)],
                            capture_output=True, text=True, cwd=REPO, env=ENV, timeout=120)
    assert report.returncode == 0, report.stderr
    trial = next(e["trial"] for e in started if e["key"] == victim)
    assert (f"lost block 0: {lost[0]['reason']}; its trial {trial} ran again on another "
            "block") in report.stdout, report.stdout
    best = json.load(open(out / "report" / "best.json"))
    assert best["lost_blocks"] == [{"block": 0, "reason": lost[0]["reason"],
                                    "time": lost[0]["time"], "trial": trial}]
    rows = {r["key"]: r for r in csv.DictReader(open(out / "report" / "trials.csv"))}
    assert rows[victim]["requeued_after"] == f"block 0 lost: {lost[0]['reason']}"
    assert rows[victim]["status"] == "done" and rows[other]["requeued_after"] == ""
    print(f"wall {time.monotonic() - start:.1f} s")


def test_a_lost_coordinator_ends_the_sweep_75_and_resume_finishes_it(tmp_path, toy_file):
    start = time.monotonic()
    marker = f"MPILEARN_TEST_MARK={tmp_path}"
    job = sweep(tmp_path, toy_file, env={"MPILEARN_TEST_MARK": str(tmp_path)}, wait=False)
    journal = tmp_path / "sweep" / "journal.jsonl"
    pid = rank_pid(marker, 0, timeout=120)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # both blocks mid-trial
        if journal.exists() and sum(e["event"] == "started" for e in read_jsonl(str(journal))) >= 2:
            break
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    stdout, stderr = job.communicate(timeout=120)
    assert job.returncode == 75, stdout[-3000:] + stderr[-3000:]
    assert stdout.count("mpilearn: the coordinator (rank 0 on ") == 1, stdout
    before = read_jsonl(str(journal))
    assert not [e for e in before if e["event"] in ("done", "failed")]
    proc = sweep(tmp_path, toy_file, "--resume")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = read_jsonl(str(journal))
    done = [e["key"] for e in events if e["event"] == "done"]
    assert len(done) == BUDGET and len(set(done)) == BUDGET
    in_flight = {e["key"] for e in before if e["event"] == "started"}
    requeued = {e["key"] for e in events[len(before):] if e["event"] == "started"
                and e.get("requeued")}
    assert in_flight == requeued, json.dumps(events[len(before):])[:2000]
    print(f"wall {time.monotonic() - start:.1f} s")
