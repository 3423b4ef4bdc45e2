"""A killed launcher's Open MPI session directory (``cluster/sessiondir.py``): the next mpirun
that gets its pid stops before any rank runs (CI of stop 62); ``mpilearn-run`` removes such
directories before it launches, and the one of a launcher that was killed under it."""
import os
import signal
import subprocess
import sys
import time

from conftest import ENV, PMIX_START_FAILURE, REPO


def killed_launcher_session(tmpdir, env):
    """A real mpirun, SIGKILLed once its session exists: returns its left-behind directory."""
    job = subprocess.Popen(["mpirun", "-np", "1", "sleep", "30"], env=env, cwd=REPO,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    session = os.path.join(tmpdir, f"ompi.{job.pid}")
    deadline = time.monotonic() + 60
    while not (os.path.isdir(session) and any(n.startswith("pmix.") for n in os.listdir(session))):
        assert time.monotonic() < deadline, "mpirun wrote no session directory"
        time.sleep(0.1)
    ranks = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True)
    for pid in [job.pid, *map(int, ranks.stdout.split())]:  # the rank has a group of its own
        os.kill(pid, signal.SIGKILL)
    job.wait()
    assert os.path.isdir(session), "a SIGKILLed launcher left nothing: nothing to remove"
    return session


def test_a_killed_launchers_session_stops_mpirun_and_mpilearn_run_removes_it(tmp_path):
    env = {**ENV, "TMPDIR": str(tmp_path)}
    session = killed_launcher_session(str(tmp_path), env)
    # what a pid that comes round again meets: the same directory under the new launcher's pid
    plain = subprocess.run(["bash", "-c", f"mv {session} {tmp_path}/ompi.$$ && exec mpirun "
                            "-np 1 true"], env=env, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 213 and PMIX_START_FAILURE in plain.stderr, plain.stderr
    # (that launcher removed the directory as it failed: another one is left behind)
    killed_launcher_session(str(tmp_path), env)
    # mpilearn-run removes it before launching, and keeps the session of a launcher that runs
    live = tmp_path / f"ompi.{os.getpid()}"
    live.mkdir()
    run = subprocess.run([sys.executable, "-m", "mpilearn.cluster.run", "-np", "1", "true"],
                         env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr
    assert sorted(os.listdir(tmp_path)) == [live.name]


def test_mpilearn_run_removes_the_session_of_a_launcher_killed_under_it(tmp_path):
    """A rank SIGKILLs its launcher (the OOM killer's choice, a kill -9): the job fails, and
    nothing is left for a later launcher with that pid."""
    env = {**ENV, "TMPDIR": str(tmp_path)}
    kill_launcher = "import os, signal; os.kill(os.getppid(), signal.SIGKILL)"
    run = subprocess.run([sys.executable, "-m", "mpilearn.cluster.run", "-np", "1",
                          sys.executable, "-c", kill_launcher], env=env, capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert run.returncode == 128 + signal.SIGKILL, run.stderr
    assert os.listdir(tmp_path) == []


def test_the_command_for_a_plain_mpirun_names_what_it_removed(tmp_path):
    gone = subprocess.Popen(["true"])  # a pid that no longer runs
    gone.wait()
    (tmp_path / f"ompi.{gone.pid}").mkdir()
    (tmp_path / f"ompi.{os.getpid()}").mkdir()  # a launcher that runs: kept
    (tmp_path / "ompi.notapid").mkdir()
    out = subprocess.run([sys.executable, "-m", "mpilearn.cluster.sessiondir"], cwd=REPO,
                         env={**ENV, "TMPDIR": str(tmp_path)}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == (f"removed {tmp_path}/ompi.{gone.pid}: the session of a killed Open "
                          "MPI launcher\n")
    assert sorted(os.listdir(tmp_path)) == sorted([f"ompi.{os.getpid()}", "ompi.notapid"])
