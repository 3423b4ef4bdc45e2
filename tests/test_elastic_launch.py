"""mpilearn-run's elastic side (issue 45): horovodrun's --min-np/--max-np flags, an honest exit
status when ranks aborted (Open MPI 5 under --with-ft ulfm never ended a job whose ranks all
called MPI_Abort), and the relaunch mode for launchers without ULFM."""
import os
import signal
import socket
import subprocess
import sys

import pytest

from conftest import ENV, REPO, TESTS
from mpilearn.cluster.discovery import Growth
from mpilearn.cluster.run import grow_loop, honest_status


def run(*argv, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "mpilearn.run", *argv], cwd=REPO, text=True,
                          capture_output=True, timeout=timeout, env={**ENV, **(env or {})})


def test_ranks_that_all_abort_under_ulfm_end_the_job_with_their_code():
    proc = run("-np", "2", "--mpi-args=--with-ft ulfm --oversubscribe", sys.executable,
               f"{TESTS}/scripts/abort_now.py", env={"MPILEARN_ABORT_GRACE": "3"})
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "mpilearn-run: aborted: rank " in proc.stderr


@pytest.mark.unit
def test_a_recorded_abort_is_never_status_0():
    assert honest_status(0, [(1, 3)]) == 3
    assert honest_status(0, [(0, 0)]) == 1
    assert honest_status(137, [(1, 3)]) == 137
    assert honest_status(0, []) == 0


def test_min_np_adds_ulfm_and_hands_the_bounds_to_the_ranks():
    proc = run("-np", "3", "--min-np", "2", "--max-np", "4", "--dry-run", "python", "x.py")
    assert proc.returncode == 0, proc.stderr
    assert "--with-ft ulfm" in proc.stdout
    assert "-x MPILEARN_ELASTIC_MIN_RANKS" in proc.stdout
    assert "-x MPILEARN_ELASTIC_MAX_RANKS" in proc.stdout
    bad = run("-np", "3", "--min-np", "4", "--dry-run", "python", "x.py")
    assert bad.returncode == 2 and "--min-np 4 must be between 1 and -np 3" in bad.stderr


def test_relaunch_mode_runs_a_crashed_job_again_but_never_bad_input(tmp_path):
    relaunch = {"MPILEARN_ELASTIC_MODE": "relaunch"}  # plain mpirun, no ULFM
    marker = str(tmp_path / "crashed-once")
    proc = run("-np", "2", "--min-np", "1", "--mpi-args=--oversubscribe", sys.executable,
               f"{TESTS}/scripts/fail_once.py", marker, env=relaunch)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("relaunching from the newest checkpoint (restart 1 of 3)") == 1
    usage = run("-np", "2", "--min-np", "1", "--mpi-args=--oversubscribe", sys.executable,
                f"{TESTS}/scripts/fail_once.py", marker, "usage", env=relaunch)
    assert usage.returncode == 2, usage.stderr[-2000:]
    assert "relaunching" not in usage.stderr


def test_relaunch_leaves_out_a_host_whose_ranks_failed_twice(tmp_path):
    """Rank 0 crashes on every launch: after the second, its host is left out; with no host
    left, fewer than --min-np ranks remain and mpilearn-run gives up with the crash's status."""
    host = socket.gethostname()
    proc = run("-np", "2", "--min-np", "1", "-H", f"{host}:2", "--mpi-args=--oversubscribe",
               sys.executable, f"{TESTS}/scripts/fail_once.py", str(tmp_path / "never"), "always",
               env={"MPILEARN_ELASTIC_MODE": "relaunch"})
    err = proc.stderr
    assert proc.returncode == 1, err[-4000:]
    # the host is left out after its second recorded abort, not before, not later; a launch
    # that failed with no rank's abort recorded (mpirun's own start on a loaded machine, seen
    # once in CI) counts against no host and is relaunched like any crash (3 restarts)
    line = f"aborted: rank 0 (code 1 on {host}: RuntimeError: crash on every run)"
    aborts = [i for i in range(len(err)) if err.startswith(line, i)]
    leave = err.find(f"mpilearn-run: leaving out {host} (ranks there failed twice); 0 rank(s)")
    assert len(aborts) == 2 and leave > aborts[1], err[-4000:]
    assert 1 <= err.count("relaunching from the newest checkpoint") <= 3, err[-4000:]
    assert err.count("relaunching from the newest checkpoint", 0, aborts[1]) >= 1, err[-4000:]
    assert "fewer than --min-np 1 ranks left; giving up" in err[leave:]


def test_growth_asks_the_discovery_script_and_relaunches_larger_with_resume(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("a:2\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    growth = Growth(str(script), ranks=2, max_ranks=3, interval=0)
    assert growth.poll() is None  # no more slots than ranks
    hosts.write_text("")  # a script that prints no host does not end the job
    assert growth.poll() is None and growth.target is None
    hosts.write_text("a:2\nb:4\n")
    assert growth.poll() == "the host discovery script (6 slots: growing to 3 ranks)"
    assert growth.target == (3, [("a", 2), ("b", 4)])

    def command(np_, hosts_):
        return ["mpirun", "-np", str(np_), "python", "-m", "mpilearn.train"]

    launches = []

    def run_once(cmd, ranks, hosts_):  # the job: stopped for growth once (75), then done
        launches.append((cmd, ranks))
        return 75 if len(launches) == 1 else 0

    assert grow_loop(command(2, None), 2, growth, command, run_once) == 0
    assert launches[1] == (command(3, None) + ["--resume", "auto"], 3)
    # a person's stop signal during the growth's stop ends the job (75), no relaunch
    growth.target, growth.interrupted = (4, [("a", 4)]), True
    launches.clear()
    assert grow_loop(command(3, None), 3, growth, command, run_once) == 75
    assert len(launches) == 1


def test_the_growth_note_asks_the_ranks_and_their_answer_sets_the_size(tmp_path):
    """The launcher's note names the reason first (the stop line) and the target after it;
    rank 0's answer beside it (after a growth in process, or a loss) is the size polled from."""
    from mpilearn.cluster import discovery, preempt

    note = str(tmp_path / "job.signal")
    with open(note, "w") as f:
        f.write(discovery.note("the script (3 slots)", 3, [("a", 2), ("b", 1)]))
    assert discovery.requested(note) == (3, "a:2,b:1")
    with open(note, "w") as f:
        f.write("SIGTERM\n")  # a person's stop: no growth
    assert discovery.requested(note) is None and discovery.requested(None) is None
    os.environ[preempt.NOTE_ENV] = note
    try:
        assert preempt.describe(1 << signal.SIGUSR1) == "SIGTERM"
    finally:
        del os.environ[preempt.NOTE_ENV]
    growth = Growth(str(tmp_path / "absent.sh"), ranks=3, max_ranks=4, interval=0)
    growth.target = (4, [("a", 4)])
    assert not growth.grew(note)  # no answer yet
    discovery.answer(note, 4)
    assert not os.path.exists(note + ".4")  # not counted as a listening rank
    assert growth.grew(note) and growth.ranks == 4 and growth.target is None
    discovery.answer(note, 2)  # a loss: the next offer of 3 slots grows the job back
    assert growth.grew(note) and growth.ranks == 2
