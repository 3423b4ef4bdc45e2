"""The sweep at scale: 64 simulated workers against the real coordinator (one rank plays the
blocks, mpilearn.hpo.simulate), a kill -9 and --resume of such a sweep, and the GP's batch
from one model that makes it possible."""
import json
import os
import signal
import subprocess
import time

import numpy as np

from conftest import ENV, REPO, mpirun, mpirun_cmd
from mpilearn.core.io import read_jsonl
from mpilearn.hpo import benchmarks
from mpilearn.hpo.searchers import make_searcher
from mpilearn.hpo.space import Space, trial_key

WORKERS, EVALS = 64, 10


def simulate_args(out, *extra, evals=EVALS):
    return ["-m", "mpilearn.hpo.simulate", "--workers", str(WORKERS), "--evals-per-worker",
            str(evals), "--median-s", "0.3", "--searcher", "gp", "--options",
            json.dumps({"n_initial": WORKERS}), "--out", str(out), *extra]


def check_every_trial_once(events, evals=EVALS):
    started = [e for e in events if e["event"] == "started"]
    done = [e for e in events if e["event"] == "done"]
    first = {}
    for e in started:  # a requeued trial keeps its number and its parameters
        assert first.setdefault(e["key"], (e["trial"], e["params"])) == (e["trial"], e["params"])
    assert sorted(t for t, _ in first.values()) == list(range(WORKERS * evals))
    assert sorted(e["key"] for e in done) == sorted(first)  # each done exactly once
    return started, done


def test_64_simulated_workers_run_every_trial_once_in_under_a_minute(tmp_path):
    proc = mpirun(2, simulate_args(tmp_path / "sim"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.seconds < 60, proc.seconds
    started, _ = check_every_trial_once(read_jsonl(str(tmp_path / "sim" / "journal.jsonl")))
    origins = [e["origin"] for e in started]
    assert origins[:WORKERS] == ["initial"] * WORKERS and "model" in origins[WORKERS:]
    sim = json.load(open(tmp_path / "sim" / "sim.json"))
    assert len(sim["trials"]) == WORKERS * EVALS
    assert len(sim["wait_s"]) == WORKERS * (EVALS + 1)  # every request answered once
    assert len(sim["latency_s"]) == WORKERS * EVALS  # decisions: trials, not releases
    assert len(sim["queued"]) == len(sim["latency_s"])  # each answer: at once, or queued
    assert set(sim["queued"]) <= {True, False}
    assert 0 < sum(sim["busy_s"]) <= sum(sim["window_s"])


def test_kill9_of_a_sweep_at_scale_then_resume(tmp_path):
    """kill -9 mid-sweep; --resume keeps every line written, re-runs the trials in flight
    with their numbers and parameters, and ends with every trial done exactly once."""
    out = tmp_path / "sim"
    path = str(out / "journal.jsonl")
    job = subprocess.Popen(mpirun_cmd(2, simulate_args(out, evals=4)), cwd=REPO, env=ENV,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    deadline = time.monotonic() + 300  # a wait, not a speed check: CI runs tests side by side
    while time.monotonic() < deadline:
        if os.path.exists(path) and sum(e["event"] == "done" for e in read_jsonl(path)) >= 100:
            break
        time.sleep(0.05)
    else:
        job.kill()
        raise AssertionError("the sweep did not get to 100 trials")
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    size = -1
    while size != os.path.getsize(path):  # the ranks outlive mpirun a moment
        size = os.path.getsize(path)
        time.sleep(1.0)
    before = open(path).read()
    before = before[:before.rfind("\n") + 1]  # whole lines
    in_flight = {e["key"] for e in read_jsonl(path) if e["event"] == "started"} - \
        {e["key"] for e in read_jsonl(path) if e["event"] == "done"}
    assert in_flight  # killed mid-sweep, trials running
    proc = mpirun(2, simulate_args(out, "--resume", evals=4), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert open(path).read().startswith(before)
    started, _ = check_every_trial_once(read_jsonl(path), evals=4)
    requeued = {e["key"] for e in started if e.get("requeued")}
    assert requeued == in_flight


def test_gp_batch_at_scale_comes_from_one_model_and_spreads():
    """Past believer_max busy points: a batch of 32 model points from one fit, none on a busy
    point, spread out, and the same batch again from a searcher rebuilt from the same
    results (what --resume relies on)."""
    space = Space.from_config(benchmarks.space("hartmann6"))
    rng = np.random.default_rng(0)
    told = [space.sample(rng) for _ in range(30)]
    busy = [space.sample(rng) for _ in range(30)]

    def searcher():
        gp = make_searcher("gp", space, 3, n_initial=10)
        gp.tell_many([(p, benchmarks.hartmann6(p)) for p in told])
        gp.asked = gp.initial_handed = 10
        return gp

    gp = searcher()
    batch = gp.ask_many(32, busy, {trial_key(p) for p in told + busy})
    assert len(batch) == 32 and {o for _, o in batch} == {"model"}
    assert gp.model.X_train_.shape[0] == 30  # one fit on the results, no believed points
    X = np.array([[p[n] for n in space.names] for p, _ in batch])
    gaps = np.linalg.norm(X[:, None] - X[None], axis=2) + np.eye(len(X))
    assert gaps.min() > 1e-3
    assert np.median([benchmarks.hartmann6(p) for p, _ in batch]) < \
        np.median([benchmarks.hartmann6(p) for p in told])  # better than what it knows
    again = searcher().ask_many(32, busy, {trial_key(p) for p in told + busy})
    assert [trial_key(p) for p, _ in again] == [trial_key(p) for p, _ in batch]


def test_bad_searcher_options_end_both_ranks_with_exit_2_and_one_message(tmp_path):
    """Rank 0 builds the searcher; rank 1 must not wait for it at a barrier (it hung)."""
    for options, says in (('{"n_initail": 4}', "search.options.n_initail"),
                          ("{n_initial: 4}", "--options is not JSON")):
        args = [a if a != json.dumps({"n_initial": WORKERS}) else options
                for a in simulate_args(tmp_path / "bad")]
        proc = mpirun(2, args, timeout=60)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert proc.stderr.count(says) == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        assert not (tmp_path / "bad" / "journal.jsonl").exists()
