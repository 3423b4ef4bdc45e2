"""mpilearn-run's elastic side (issue 45): horovodrun's --min-np/--max-np flags, an honest exit
status when ranks aborted (Open MPI 5 under --with-ft ulfm never ended a job whose ranks all
called MPI_Abort), and the relaunch mode for launchers without ULFM."""
import socket
import subprocess
import sys

import pytest

from conftest import ENV, REPO, TESTS
from mpilearn.cluster.run import honest_status


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
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.count("relaunching from the newest checkpoint") == 1
    assert f"mpilearn-run: leaving out {host} (ranks there failed twice); 0 rank(s)" in proc.stderr
    assert "fewer than --min-np 1 ranks left; giving up" in proc.stderr
