"""A rank lost at any moment of a job's start-up (issue 57): under ULFM (``mpilearn-run --min-np``:
``mpirun --with-ft ulfm``) a rank killed before it joined MPI_Init left the others waiting there
for ever, and one killed after it made each survivor print a traceback. Real mpirun, a real
``kill -9`` at a chosen point of the rank's start-up (tests/startup_kill/sitecustomize.py, on
the ranks' PYTHONPATH: production code has no test hook), with and without ULFM: the job ends
(or is relaunched) within the bound, with one line naming the rank and the phase and no
traceback; a stop signal during start-up ends the job too."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

from conftest import ENV, REPO, TESTS, wait_until_gone
from mpilearn.cluster.run import ALLOCATION_VARIABLES

BOUND = 60  # seconds from the kill to the job's end, well inside the default 120 s bound


def killer(tmp_path, at, hang=False, rank=2):
    """A folder for the ranks' PYTHONPATH that ends ``rank`` at ``at`` (sitecustomize.py)."""
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(os.path.join(TESTS, "startup_kill", "sitecustomize.py"), site)
    (site / "kill.json").write_text(json.dumps({"rank": rank, "at": at, "hang": hang}))
    return site


def config(tmp_path, toy_file, output=True):
    """The README's toy MLP, one short epoch; its run directory given, or (``output=False``,
    as in the README) the default one."""
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump({
        "model": f"{REPO}/models/mlp.py", "data": {"files": [toy_file]},
        "train": {"epochs": 1, "batch_size": 32, "max_steps_per_epoch": 2},
        **({"output": str(tmp_path / "run")} if output else {})}))
    return str(path)


def env_with(site, **extra):
    path = os.pathsep.join(filter(None, [str(site), ENV.get("PYTHONPATH")]))
    env = {**ENV, "PYTHONPATH": path, **extra}
    for name in ALLOCATION_VARIABLES:  # every rank on this machine, as mpilearn-run knows
        env.pop(name, None)
    return env


def run(cmd, env, timeout=240, cwd=REPO):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    proc.ended = time.time()
    proc.output = (proc.stdout + proc.stderr).replace("\0", "")
    return proc


def mpilearn_run(tmp_path, toy_file, site, *flags, env=None, output=True):
    cmd = [sys.executable, "-m", "mpilearn.run", "-np", "3", *flags,
           sys.executable, "-m", "mpilearn.train", "--no-progress", "--config",
           config(tmp_path, toy_file, output)]
    # without an output: the default run directory, runs/<model>-<time> under the test's folder
    return run(cmd, env_with(site, **(env or {})), cwd=REPO if output else tmp_path)


def killed_at(site):
    """When the rank died (the helper wrote it), so that the job's end is measured from there."""
    text = (site / "killed").read_text().strip()
    assert text, "the rank was never killed"
    return float(text)


def lost_lines(output):
    return [line for line in output.splitlines()
            if re.match(r"mpilearn(-run)?: lost rank 2 on \S+ during start-up", line)]


@pytest.mark.parametrize("at, phase", [
    ("start", "its interpreter's start, before mpilearn ran"),  # before any mpilearn code
    ("mpi init", "MPI's initialisation"),                    # inside MPI_Init
    ("open toy.yaml", None),  # past MPI_Init, before the config is read: MPI reports it
], ids=["interpreter-start", "during-mpi-init", "before-the-config"])
def test_ulfm_a_rank_lost_in_start_up_ends_the_job_with_one_line_and_75(
        toy_file, tmp_path, at, phase):
    """Under ULFM, before this fix: the survivors waited in MPI_Init for ever (the first two)
    or printed a traceback each (the third). Now one line names rank 2 and its phase, no
    traceback, exit 75 with the relaunch asked (--max-restarts 0: not taken here)."""
    site = killer(tmp_path, at)
    proc = mpilearn_run(tmp_path, toy_file, site, "--min-np", "2", "--max-restarts", "0")
    assert proc.returncode == 75, proc.output[-3000:]
    assert proc.ended - killed_at(site) < BOUND, proc.output[-3000:]
    assert " --with-ft ulfm " in proc.output
    assert "Traceback" not in proc.output, proc.output[-3000:]
    lines = lost_lines(proc.output)
    assert len(lines) == 1, proc.output[-3000:]
    if phase is not None:  # the launcher saw it die: the phase it was in
        assert lines[0].startswith(f"mpilearn-run: lost rank 2 on ") and \
            f"during start-up ({phase}), where the other ranks cannot notice it" in lines[0], \
            lines[0]
    else:  # either the survivors said it (their membership) or the launcher did
        assert "during start-up (3 -> 2 ranks); nothing trained was lost" in lines[0] or \
            "during start-up (reading the config)" in lines[0], lines[0]


def test_ulfm_a_rank_lost_before_the_mpi_import_is_relaunched_and_the_job_finishes(
        toy_file, tmp_path):
    """The issue's command (``mpilearn-run -np 3 --min-np 2 ... --config toy.yaml``, a config
    without ``output``), rank 2 killed as it imports MPI: relaunched as any start-up loss, as
    it was (nothing was written yet; ``--resume auto`` without a run directory is refused), and
    the relaunch trains to the end."""
    site = killer(tmp_path, "import mpi4py")
    proc = mpilearn_run(tmp_path, toy_file, site, "--min-np", "2", output=False)
    assert proc.returncode == 0, proc.output[-3000:]
    assert "Traceback" not in proc.output, proc.output[-3000:]
    lines = lost_lines(proc.output)
    assert len(lines) == 1 and "during start-up (MPI's initialisation)" in lines[0], proc.output
    relaunched = [line for line in proc.output.splitlines() if "relaunching" in line]
    assert relaunched == [
        f"mpilearn-run: the job {lines[0].split(': ', 1)[1].split(', where')[0]}, exit 75; "
        "relaunching it as it was (nothing was written yet) (restart 1 of 3)"], proc.output
    done = re.search(r"mpilearn: done after 1 epoch\(s\); results in (\S+)", proc.output)
    assert done and os.path.exists(tmp_path / done.group(1) / "models" / "model.pt")


def test_ulfm_a_rank_lost_once_the_run_directory_is_chosen_resumes_there(toy_file, tmp_path):
    """Rank 0 lost after it chose the run directory (the default one, ``runs/<model>-<time>``),
    as it writes the run's config.yaml there: the relaunch resumes in that directory
    (``--resume auto --output`` it), not in a new default one (before: ``--resume needs the run
    directory``, exit 2)."""
    site = killer(tmp_path, "rename config.yaml", rank=0)
    proc = mpilearn_run(tmp_path, toy_file, site, "--min-np", "2", output=False)
    assert proc.returncode == 0, proc.output[-3000:]
    assert "Traceback" not in proc.output, proc.output[-3000:]
    [relaunched] = [line for line in proc.output.splitlines() if "relaunching" in line]
    assert re.fullmatch(r"mpilearn-run: the job lost rank 0 on \S+ during start-up \(3 -> 2 "
                        r"ranks\), exit 75; relaunching it with --resume auto \(restart 1 of 3\)",
                        relaunched), proc.output[-3000:]
    runs = os.listdir(tmp_path / "runs")
    assert len(runs) == 1 and (tmp_path / "runs" / runs[0] / "models" / "model.pt").exists()


@pytest.mark.parametrize("at, phase", [("import mpi4py", "MPI's initialisation"),
                                       ("open toy.yaml", "reading the config")],
                         ids=["before-mpi-import", "before-the-config"])
def test_plain_mpirun_ends_at_once_naming_the_rank_and_its_phase(toy_file, tmp_path, at,
                                                                   phase):
    """Without ULFM the launcher ends the job itself; mpilearn-run's line now says where the
    lost rank was."""
    site = killer(tmp_path, at)
    proc = mpilearn_run(tmp_path, toy_file, site)
    assert proc.returncode == 137, proc.output[-3000:]
    assert proc.ended - killed_at(site) < BOUND
    assert "Traceback" not in proc.output, proc.output[-3000:]
    ours = [line for line in proc.output.splitlines() if line.startswith("mpilearn-run: the job")]
    assert len(ours) == 1, proc.output[-3000:]
    assert re.match(r"mpilearn-run: the job ended: rank 2 on host \S+ \(pid \d+\): killed by "
                    rf"SIGKILL, during start-up \({re.escape(phase)}\);", ours[0]), ours[0]


def test_ulfm_without_mpilearn_run_the_ranks_own_bound_ends_the_wait(toy_file, tmp_path):
    """A plain ``mpirun --with-ft ulfm`` (or a rank mpilearn-run cannot see, on another node):
    the survivors' bound on MPI_Init (MPILEARN_START_TIMEOUT) ends them with status 1 and one
    line, where they waited for ever."""
    site = killer(tmp_path, "import mpi4py")
    cmd = ["mpirun", "--with-ft", "ulfm", "-np", "3", "--oversubscribe", "-x", "PYTHONPATH",
           "-x", "MPILEARN_START_TIMEOUT", sys.executable, "-m", "mpilearn.train",
           "--no-progress", "--config", config(tmp_path, toy_file)]
    start = time.time()
    proc = run(cmd, env_with(site, MPILEARN_START_TIMEOUT="6"))
    assert proc.returncode == 1, proc.output[-3000:]
    assert 6 <= proc.ended - start < 6 + BOUND, proc.output[-3000:]
    assert "Traceback" not in proc.output and "Timeout" not in proc.output, proc.output[-3000:]
    lines = [line for line in proc.output.splitlines() if line.startswith("mpilearn: ")]
    assert lines == [
        "mpilearn: gave up its start-up after 6 s in MPI's initialisation, which waits for every "
        "rank: a rank was lost, or never started, before it joined; nothing trained was lost: "
        "run it again with --resume auto (the bound: MPILEARN_START_TIMEOUT, mpilearn-run "
        "--start-timeout)"], proc.output[-3000:]


def test_a_rank_stuck_before_mpi_init_is_bounded_under_mpilearn_run_too(toy_file, tmp_path):
    """Rank 2 alive but stuck before MPI_Init (nothing for mpilearn-run to see die): the
    ranks' bound (``--start-timeout``) ends the job, and mpilearn-run reads it as a start-up
    loss: 75, a relaunch asked (--max-restarts 0: not taken)."""
    site = killer(tmp_path, "import mpi4py", hang=True)
    start = time.time()
    proc = mpilearn_run(tmp_path, toy_file, site, "--min-np", "2", "--max-restarts", "0",
                        "--start-timeout", "5")
    assert proc.returncode == 75, proc.output[-3000:]
    assert 5 <= proc.ended - start < 5 + BOUND, proc.output[-3000:]
    ours = [line for line in proc.output.splitlines() if line.startswith("mpilearn")]
    assert len(ours) == 2 and ours[1].startswith("mpilearn: gave up its start-up after 5 s in "
                                                 "MPI's initialisation"), proc.output[-3000:]
    assert "Traceback" not in proc.output, proc.output[-3000:]
    wait_until_gone(str(tmp_path / "toy.yaml"), timeout=20)  # the stuck rank too


def test_sigterm_to_mpilearn_run_ends_a_start_up_stuck_in_mpi_init(toy_file, tmp_path):
    """Rank 2 stops for good before MPI_Init (a hung file system, say): ranks 0 and 1 wait in
    MPI_Init, where a stop signal's handler cannot run. SIGTERM to mpilearn-run ends the job
    MPILEARN_START_STOP_GRACE seconds later, exit 75, no relaunch (a stop is final)."""
    site = killer(tmp_path, "import mpi4py", hang=True)
    cmd = [sys.executable, "-m", "mpilearn.run", "-np", "3", "--min-np", "2",
           sys.executable, "-m", "mpilearn.train",
           "--no-progress", "--config", config(tmp_path, toy_file)]
    job = subprocess.Popen(cmd, cwd=REPO, env=env_with(site, MPILEARN_START_STOP_GRACE="3"),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, stopped = time.monotonic() + 120, site / "killed"
    while not (stopped.exists() and stopped.read_text().strip()):  # rank 2 stopped for good
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()[0]
        time.sleep(0.05)
    time.sleep(1)  # ranks 0 and 1 in MPI_Init
    sent = time.monotonic()
    job.send_signal(signal.SIGTERM)
    output, _ = job.communicate(timeout=120)
    took = time.monotonic() - sent
    assert job.returncode == 75, output[-3000:]
    assert 3 <= took < 3 + BOUND, (took, output[-3000:])
    ours = [line for line in output.splitlines() if "stopped by SIGTERM" in line]
    assert len(ours) == 1 and ours[0].startswith(
        "mpilearn-run: stopped by SIGTERM during start-up: 3 s later ranks were still starting "
        "(rank 0: MPI's initialisation, rank 1: MPI's initialisation, rank 2: MPI's "
        "initialisation)"), output[-3000:]
    assert "relaunching" not in output and "Traceback" not in output, output[-3000:]
    wait_until_gone(str(tmp_path / "toy.yaml"), timeout=20)  # the stuck rank is gone too


def test_a_sweep_that_lost_a_rank_before_mpi_init_ends_too(tmp_path):
    """The same wait under ``python -m mpilearn.optimize`` (a sweep, ULFM): one line, 75."""
    site = killer(tmp_path, "import mpi4py", rank=1)
    path = tmp_path / "hpo.yaml"
    path.write_text(yaml.safe_dump({
        "output": str(tmp_path / "sweep"),
        "search": {"searcher": "random", "budget": 2, "blocks": 1, "folds": 1,
                   "objective": {"function": "objectives:fragile"},
                   "space": {"x": {"type": "real", "low": 0, "high": 1}}}}))
    proc = run([sys.executable, "-m", "mpilearn.run", "-np", "3", "--min-np", "2",
                "--max-restarts", "0", sys.executable, "-m", "mpilearn.optimize", "--config",
                str(path), "--no-progress"],
               env_with(site, PYTHONPATH=os.pathsep.join([str(site), TESTS])))
    assert proc.returncode == 75, proc.output[-3000:]
    assert proc.ended - killed_at(site) < BOUND
    lines = [line for line in proc.output.splitlines() if "lost rank 1" in line]
    assert len(lines) == 1 and lines[0].startswith("mpilearn-run: lost rank 1 on ") and \
        "during start-up (MPI's initialisation)" in lines[0], proc.output[-3000:]
    assert "Traceback" not in proc.output, proc.output[-3000:]
