"""Every wait in training is bounded: a rank that sleeps for ever inside a step ends the job
within the watchdog's time, with its stack saved and one line naming it; without the watchdog
the same job hangs."""
import os
import signal
import subprocess
import time

import pytest

from conftest import ENV, REPO, TESTS, mpirun, mpirun_cmd, train_args, wait_until_gone
from mpilearn.core.watchdog import WATCHDOG_EXIT, Watchdog, watching
from mpilearn.errors import UsageError
from mpilearn.train.checks import check_watchdog

FLOOR = 3  # seconds: the test's floor (60 by default)


def hanging_job(toy_file, out, marker, watchdog: bool):
    return train_args("--set", f"model={TESTS}/models/crash.py", "--set", f"hparams.hang={marker}",
                      "--set", f"data.files=[{toy_file}]", "--set", "train.batch_size=8",
                      "--set", f"train.watchdog.enabled={str(watchdog).lower()}",
                      "--set", f"train.watchdog.floor_s={FLOOR}", "--output", str(out))


def test_a_rank_asleep_in_a_step_ends_the_job_with_its_stack(toy_file, tmp_path):
    out, marker = tmp_path / "run", tmp_path / "hung"
    proc = mpirun(2, hanging_job(toy_file, out, marker, watchdog=True), timeout=120)
    hung_for = time.time() - os.path.getmtime(marker)
    assert proc.returncode == WATCHDOG_EXIT, proc.stderr[-3000:]
    # the limit, the thread's poll and the launcher's teardown
    assert hung_for < FLOOR + 10, f"ended {hung_for:.1f} s after the hang began"
    lines = [l for l in proc.stderr.splitlines() if "watchdog:" in l]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("mpilearn: watchdog: rank 1 on ")
    assert "stuck at train_step (" in lines[0] and "crash.py" in lines[0]
    stack = (out / "watchdog-rank1.txt").read_text()
    assert "crash.py" in stack and "train_step" in stack
    assert not (out / "watchdog-rank0.txt").exists()  # rank 0 only waited for rank 1


def test_without_the_watchdog_the_same_job_hangs(toy_file, tmp_path):
    out, marker = tmp_path / "run", tmp_path / "hung"
    job = subprocess.Popen(mpirun_cmd(2, hanging_job(toy_file, out, marker, watchdog=False)),
                           cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.1)
        assert marker.exists(), "the job never reached its hanging step"
        # twice the time in which the watchdog ended it, and it still runs
        with pytest.raises(subprocess.TimeoutExpired):
            job.wait(timeout=2 * (FLOOR + 2))
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        wait_until_gone(out)


def test_the_limit_is_the_floor_or_factor_times_the_median_step(tmp_path):
    dog = Watchdog(0, str(tmp_path), floor_s=2.0, factor=10.0)
    assert dog.limit() == 20.0  # nothing measured yet: a first step also compiles
    dog.steps.extend([0.1, 0.5, 0.1])
    assert dog.limit() == 2.0
    dog.steps.extend([0.5, 0.5])
    assert dog.limit() == 5.0
    with watching(dog):  # a growth: a spawned rank starts as a job does
        assert dog.armed and dog.limit() == 20.0
    assert not dog.armed and dog.limit() == 5.0


def test_a_beat_costs_under_a_microsecond_or_two(tmp_path):
    dog = Watchdog(0, str(tmp_path))
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        dog.beat()
    per_beat = (time.perf_counter() - start) / n
    assert per_beat < 20e-6, f"{per_beat * 1e6:.1f} us a beat"  # loose: a loaded machine


def test_bounds_must_be_positive_and_a_misspelt_key_is_named():
    from mpilearn.core.config import resolve

    with pytest.raises(UsageError, match="did you mean 'train.watchdog.floor_s'"):
        resolve(None, ["train.watchdog.flor_s=3"], require_model=False)
    check_watchdog({"enabled": True, "floor_s": 60.0, "factor": 10.0})
    with pytest.raises(UsageError, match="train.watchdog.floor_s must be positive"):
        check_watchdog({"enabled": True, "floor_s": 0, "factor": 10.0})


def test_in_a_sweep_the_stuck_rank_ends_the_job_and_its_trial_stays_in_flight(toy_file, tmp_path):
    """Without ULFM the block's other rank cannot leave the collective it waits in: the job
    ends (124, which the jobs/ scripts requeue) and --resume runs the trial again."""
    import yaml

    from mpilearn.core.io import read_jsonl

    marker = tmp_path / "hung"
    cfg = {"model": f"{TESTS}/models/crash.py", "hparams": {"hang": str(marker)},
           "data": {"files": [toy_file]}, "output": str(tmp_path / "sweep"),
           "train": {"epochs": 1, "batch_size": 8, "watchdog": {"floor_s": FLOOR}},
           "search": {"searcher": "random", "budget": 2, "blocks": 1, "folds": 1,
                      "ranks_per_fold": 2, "objective": {"metric": "val_loss"},
                      "space": {"lr": {"type": "real", "low": 1e-3, "high": 0.1}}}}
    path = tmp_path / "hpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = mpirun(3, ["-m", "mpilearn.optimize", "--config", str(path), "--no-progress"],
                  timeout=180)
    assert proc.returncode == WATCHDOG_EXIT, proc.stderr[-3000:]
    lines = [l for l in proc.stderr.splitlines() if "watchdog:" in l]
    assert len(lines) == 1 and "watchdog: rank 1 on " in lines[0], proc.stderr[-3000:]
    assert list((tmp_path / "sweep").glob("trials/*/fold*/watchdog-rank1.txt"))
    events = read_jsonl(str(tmp_path / "sweep" / "journal.jsonl"))
    assert [e["event"] for e in events if e["event"] in ("started", "done", "failed")] == \
        ["started"]  # in flight: --resume runs it again
