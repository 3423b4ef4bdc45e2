"""One writer per run directory, without SLURM: a second run on a directory that one trains
exits 2 naming the first; a lock whose holder on another host stopped its heartbeat is taken
over with one line; --force-unlock overrides a live one and says whose it was. (kill -9 of
the holder, then a resume that takes the lock over: tests/test_resume.py.)"""
import json
import os
import socket
import subprocess
import time

from conftest import ENV, REPO, TESTS, mpirun, mpirun_cmd, train_args
from mpilearn.core.io import read_jsonl


def args(toy_file, out, epochs=1, steps=8, sleep=0.15):
    return train_args("--set", f"model={TESTS}/models/slow.py", "--set", f"data.files=[{toy_file}]",
                      "--set", f"train.epochs={epochs}", "--set", "train.batch_size=16",
                      "--set", f"train.max_steps_per_epoch={steps}", "--set", f"hparams.sleep={sleep}",
                      "--output", out, "--resume", "auto")


def test_a_second_run_is_refused_and_a_dead_holder_is_taken_over(toy_file, tmp_path):
    out = str(tmp_path / "run")
    lock = os.path.join(out, ".mpilearn.lock")
    first = subprocess.Popen(mpirun_cmd(2, args(toy_file, out, epochs=3, steps=40)), cwd=REPO,
                             env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not os.path.exists(os.path.join(out, "config.yaml")):
        time.sleep(0.1)
    holder = json.load(open(lock))
    second = mpirun(1, args(toy_file, out))
    assert first.poll() is None, "the first run ended before the second started"
    assert second.returncode == 2, second.stderr
    lines = [l for l in second.stderr.splitlines() if l.startswith("mpilearn: error:")]
    assert len(lines) == 1, second.stderr
    assert (f"{out} is being written by another job (host {socket.gethostname()}, PID "
            f"{holder['pid']}, no batch job, started {holder['started']}") in lines[0], lines
    assert "--force-unlock" in lines[0]
    stdout, stderr = first.communicate(timeout=180)
    assert first.returncode == 0, stderr
    assert [r["epoch"] for r in read_jsonl(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3]
    assert not os.path.exists(lock)  # released at the end



def test_a_stale_holder_elsewhere_is_taken_over_and_force_unlock_names_a_live_one(tmp_path,
                                                                                   monkeypatch):
    """The lock itself (rank 0's side): a holder on another host is judged by its heartbeat."""
    import pytest

    from mpilearn.core.runlock import RunLock
    from mpilearn.errors import UsageError

    monkeypatch.setenv("MPILEARN_LOCK_HEARTBEAT", "1")  # stale after 4 s
    path = str(tmp_path / ".mpilearn.lock")
    other = {"host": "node-elsewhere", "pid": 4242, "slurm_job": "", "slurm_cluster": "",
             "mpijob": "", "started": "2026-01-01 00:00:00 UTC", "token": "x"}

    def leave(age):
        with open(path, "w") as f:
            json.dump(other, f)
        os.utime(path, (time.time() - age, time.time() - age))

    leave(10)
    lock = RunLock(path, str(tmp_path))
    notes = lock.acquire()
    assert len(notes) == 1 and "took over the lock" in notes[0], notes
    assert "host node-elsewhere, PID 4242" in notes[0] and "its heartbeat stopped" in notes[0]
    assert json.load(open(path))["token"] == lock.me["token"]
    time.sleep(2.5)  # the holder's heartbeat keeps its lock fresh
    assert time.time() - os.stat(path).st_mtime < 2
    lock.release()
    assert not os.path.exists(path)

    leave(1)  # alive: refused, naming it, unless --force-unlock
    with pytest.raises(UsageError, match="host node-elsewhere, PID 4242, no batch job"):
        RunLock(path, str(tmp_path)).acquire()
    forced = RunLock(path, str(tmp_path))
    notes = forced.acquire(force=True)
    assert len(notes) == 1 and "--force-unlock: removed the lock" in notes[0], notes
    assert "node-elsewhere" in notes[0]
    forced.release()


def test_a_holder_left_a_zombie_is_gone_and_its_lock_taken_over(tmp_path):
    """A rank that its launcher killed stays a zombie until PID 1 reaps it (MPICH's Hydra after
    an MPI_Abort; seconds in a container): its lock must not refuse the relaunch."""
    from mpilearn.core.runlock import RunLock

    path = str(tmp_path / ".mpilearn.lock")
    zombie = subprocess.Popen(["true"])  # ended, not waited for: a zombie
    while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    try:
        with open(path, "w") as f:
            json.dump({"host": socket.gethostname(), "pid": zombie.pid, "slurm_job": "",
                       "slurm_cluster": "", "mpijob": "", "started": "now", "token": "x"}, f)
        lock = RunLock(path, str(tmp_path))
        notes = lock.acquire()
        assert len(notes) == 1 and f"its process {zombie.pid} on" in notes[0], notes
        lock.release()
    finally:
        zombie.wait()
