"""The one line names the cause: a rank killed in a sweep is named with its host and how it
ended, and the SIGTERM the launcher then sent the survivors is not blamed."""
import os
import signal
import subprocess
import sys
import time

from conftest import ENV, REPO, TESTS, wait_until_gone
from mpilearn.cluster import cause
from mpilearn.core.io import read_jsonl
from test_hpo import sweep_config


def rank_pid(marker: str, rank: int):
    """The pid of the process of world rank ``rank`` whose command line names ``marker``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"OMPI_COMM_WORLD_RANK={rank}".encode() in f.read().split(b"\0"):
                    return int(pid)
        except OSError:
            pass
    return None


def test_a_killed_block_rank_is_named_and_the_survivors_sigterm_is_not(tmp_path):
    cfg = sweep_config(tmp_path, budget=10, objective={"function": "objectives:slow_quadratic"},
                       space={"x": {"type": "real", "low": 0, "high": 1}})
    journal = tmp_path / "sweep" / "journal.jsonl"
    cmd = [sys.executable, "-m", "mpilearn.run", "-np", "3", "--mpi-args=--oversubscribe",
           sys.executable, "-m", "mpilearn.optimize", "--config", str(cfg), "--no-progress"]
    job = subprocess.Popen(cmd, cwd=REPO, env={**ENV, "PYTHONPATH": f"{REPO}:{TESTS}"},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
                journal.exists() and any(r["event"] == "done" for r in read_jsonl(str(journal)))):
            time.sleep(0.05)
        victim = rank_pid(str(cfg), 2)
        assert victim, "rank 2 not found"
        os.kill(victim, signal.SIGKILL)
        out, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 137, out[-3000:]
    lines = [l for l in out.splitlines() if l.startswith("mpilearn-run: the job ended")]
    assert len(lines) == 1, out[-3000:]
    assert "rank 2 on host " in lines[0] and f"(pid {victim}): killed by SIGKILL" in lines[0]
    assert "stopping the sweep" not in out and "SIGTERM" not in out, out[-3000:]


def test_the_launchers_reports_are_read_and_oom_kills_named():
    prte = ("prterun noticed that process rank 1 with PID 1822 on node vm exited on\n"
            "signal 9 (Killed).\n")
    assert cause.first_failure(prte) == "rank 1 on host vm (pid 1822): killed by SIGKILL"
    srun = "srun: error: nid0042: task 3: Exited with exit code 1\n"
    assert cause.first_failure(srun) == "rank 3 on host nid0042: exited with status 1"
    line = cause.describe(prte, 137, 4, 5)
    assert "the kernel's OOM killer ended 1 process(es)" in line
    assert "OOM killer ended" not in cause.describe(prte, 137, 4, 4)
    assert line.endswith("the other ranks were stopped because of it")
    alone = cause.describe(prte, 137, 4, 4, ranks=1)  # a job of one rank has no others
    assert "other ranks" not in alone and alone.endswith("another node's is not)")
    assert cause.oom_kills() is None or cause.oom_kills() >= 0
    assert cause.crashed(prte) == cause.first_failure(prte)
    assert cause.crashed("[vm:08244] *** Process received signal ***\n[vm:08244] Signal: "
                         "Segmentation fault (11)\n") == "pid 8244 on host vm: killed by SIGSEGV"
    assert cause.crashed(srun) is None


def test_a_job_stuck_after_its_end_is_ended_with_the_run_status_and_the_crash_named(tmp_path):
    """Rank 0 recorded the end, a rank then crashed and the other waits for good (as in
    MPI_Finalize): mpilearn-run ends the launcher MPILEARN_END_GRACE seconds later, names the
    crash, and exits with the run's own status, not a hang."""
    cmd = [sys.executable, "-m", "mpilearn.run", "-np", "2", "--min-np", "1",
           "--mpi-args=--oversubscribe", sys.executable,
           os.path.join(TESTS, "scripts", "stuck_after_end.py")]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env={**ENV, "MPILEARN_END_GRACE": "3"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert " --with-ft ulfm " in proc.stderr  # where a crash does not end the job by itself
    (line,) = [l for l in proc.stderr.splitlines() if "has not exited" in l]
    assert line.startswith("mpilearn-run: the job finished (rank 0's status 0) and its "
                           "launcher has not exited 3 s later: ranks stuck in their exit (MPI_Finalize) "
                           "after pid "), line  # the rank's own report: the launcher has none yet
    assert "killed by SIGSEGV; everything was written; ending it" in line, line
    assert time.monotonic() - start < 100  # the line above proves the end; a backstop for slow days
    wait_until_gone("stuck_after_end.py", timeout=10)
