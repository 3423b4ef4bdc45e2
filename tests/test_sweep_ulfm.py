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


def sweep(tmp_path, toy_file, *extra, env=None, wait=True, min_np=False, parallel=False,
          model="armed_slow.py", hparams=None):
    """The sweep on np=5 under ``mpirun --with-ft ulfm`` with ``search.elastic: true``, or
    (``min_np``) under ``mpilearn-run --min-np 3``, which adds both. Two blocks of two ranks:
    both in each fold (sequential), or one in each (``parallel``)."""
    cfg = {"model": f"{TESTS}/models/{model}", "output": str(tmp_path / "sweep"),
           "data": {"files": [toy_file]}, "hparams": hparams or {"sleep": 0.02},
           "train": {"epochs": 1, "batch_size": 4, "checkpoint_every_steps": 10},
           "search": {"searcher": "random", "budget": BUDGET, "blocks": 2, "folds": 2,
                      "fold_mode": "parallel" if parallel else "sequential",
                      "ranks_per_fold": 1 if parallel else 2, "elastic": not min_np,
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


def test_a_lost_fold_rank_in_parallel_folds_costs_its_trial_with_no_race(tmp_path, toy_file):
    """Folds in parallel: rank 2 (block 0's fold 1) dies; its block-mate (rank 1, training
    fold 0, whose steps from its 12th on take 0.5 s: it is mid-step at the loss) leaves
    after its step, and only then is the trial requeued, each fold from its own checkpoint:
    the old block never writes the folds the new one reads."""
    start = time.monotonic()
    steps = tmp_path / "steps"
    steps.mkdir()
    proc = sweep(tmp_path, toy_file, parallel=True,
                 env={"MPILEARN_TEST_KILL": f"2:{KILL_AT}", "MPILEARN_TEST_STEP_LOG": str(steps),
                      "MPILEARN_TEST_SLOW": "1:12:0.5"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = read_jsonl(str(tmp_path / "sweep" / "journal.jsonl"))
    done = [e["key"] for e in events if e["event"] == "done"]
    assert len(done) == BUDGET and len(set(done)) == BUDGET  # exactly the budget, each once
    [lost] = [e for e in events if e["event"] == "block_lost"]
    assert lost["block"] == 0 and lost["reason"].startswith("rank 2 on host "), lost
    [stopped] = [e for e in events if e["event"] == "interrupted"]
    victim = stopped["key"]
    # rank 1 left its fold well before its end (128 steps) once MPI told it of the loss (its
    # progress runs at rank 1's MPI calls: here 1-5 of its slow steps), and the trial was
    # requeued only after that: no step of block 0 after the requeue
    mate = [float(t) for t in (steps / "rank1").read_text().split()]
    died = max(float(t) for t in (steps / "rank2").read_text().split())
    after = [t - died for t in mate if t > died]
    assert len(mate) < 64 and after, (len(mate), after)
    assert max(mate) < stopped["time"], (after, stopped["time"] - died)
    again = [e for e in events if e["event"] == "started" and e["key"] == victim
             and e.get("requeued")]
    assert len(again) == 1 and again[0]["block"] == 1
    assert events.index(stopped) < events.index(again[0])
    # each fold from its own checkpoint: fold 1 from the victim's last (step 30), fold 0 from
    # the last its block-mate wrote before leaving
    resumed = {line.split("]")[0]: line for line in proc.stdout.splitlines()
               if f"[trial {victim} fold" in line and "mpilearn: resumed from" in line}
    assert f"ckpt-e0000-s{KILL_AT:07d}.pt" in resumed[f"[trial {victim} fold 1"], resumed
    assert f"{victim}/fold0/checkpoints/ckpt-e0000-s" in resumed[f"[trial {victim} fold 0"]
    print(f"wall {time.monotonic() - start:.1f} s")


def test_an_elastic_keras_sweep_loses_a_rank_and_keeps_its_budget(tmp_path, toy_file):
    """A Keras task (TensorFlow, its step one tf.function: the allreduce inside the graph turns
    MPI's loss report into TensorFlow's own error) under search.elastic: block 0's rank 2
    killed mid-trial costs that trial once, which runs again on block 1 from its checkpoint."""
    proc = sweep(tmp_path, toy_file, model="elastic_keras.py", hparams={"dropout": 0.0, "count": 0},
                 env={"MPILEARN_TEST_KILL": f"2:{KILL_AT}", "KERAS_BACKEND": "tensorflow",
                      "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = read_jsonl(str(tmp_path / "sweep" / "journal.jsonl"))
    done = [e["key"] for e in events if e["event"] == "done"]
    assert len(done) == BUDGET and len(set(done)) == BUDGET
    [lost] = [e for e in events if e["event"] == "block_lost"]
    assert lost["block"] == 0 and lost["reason"].startswith("rank 2 on host "), lost
    [stopped] = [e for e in events if e["event"] == "interrupted"]
    again = [e for e in events if e["event"] == "started" and e["key"] == stopped["key"]
             and e.get("requeued")]
    assert len(again) == 1 and again[0]["block"] == 1
    assert f"[trial {stopped['key']} fold 0] mpilearn: resumed from" in proc.stdout


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
