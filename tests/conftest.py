"""Shared helpers: real mpirun launches (never a mocked MPI), toy data files."""
import os
import shutil
import subprocess
import sys
import time
import types

import pytest
from filelock import FileLock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")
# A rank that waits (for its peer's allreduce, for rank 0) yields the core instead of
# spinning on it. Open MPI does this by itself only when one job's ranks outnumber the
# cores; here two pytest workers' jobs (and SLURM's, which inherit this environment) share
# two cores, and a spinning rank took the core its peer needed: an np=2 run beside the
# suite took 12.7 CPU-s spinning, 7.0 yielding.
os.environ["OMPI_MCA_mpi_yield_when_idle"] = "1"
ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
       "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}


def mpirun_cmd(np_, args):
    return ["mpirun", "-np", str(np_), "--oversubscribe", sys.executable] + list(args)


PMIX_START_FAILURE = "PMIx server's listener thread failed to start"


@pytest.fixture(autouse=True)
def no_left_behind_sessions():
    """The suite kills launchers (kill -9) by design; their Open MPI session directories would
    stop a later mpirun that gets the same pid (exit 213, ``cluster/sessiondir.py``). Before
    every test, as ``mpilearn-run`` does before every launch."""
    from mpilearn.cluster import sessiondir

    sessiondir.remove_left_behind()


def mpirun(np_, args, timeout=300, cwd=None, env=None):
    """Run ``python ARGS`` on np_ ranks; returns CompletedProcess (text)."""
    from mpilearn.cluster import sessiondir

    start = time.monotonic()
    for attempt in range(2):
        sessiondir.remove_left_behind()
        proc = subprocess.run(mpirun_cmd(np_, args), capture_output=True, text=True,
                              timeout=timeout, cwd=cwd or REPO, env={**ENV, **(env or {})})
        # a launcher another worker killed in between, whose pid this one got (the cleanup
        # above came first): only that is run again, with a new pid
        if PMIX_START_FAILURE not in proc.stderr:
            break
    # Open MPI's output forwarding once put a NUL byte before a rank's line (CI of stop 51); a
    # terminal shows nothing for it, and the tests read the text a person sees
    proc.stdout, proc.stderr = proc.stdout.replace("\0", ""), proc.stderr.replace("\0", "")
    proc.seconds = time.monotonic() - start
    return proc


def kill9_after_mid_epoch_checkpoint(np_, args, out, env=None, epoch=1):
    """Start ``python ARGS`` on np_ ranks, kill -9 the whole job once a mid-epoch checkpoint
    of epoch ``epoch`` (0-based) exists; returns that checkpoint's name."""
    import signal

    job = subprocess.Popen(mpirun_cmd(np_, args), cwd=REPO, env={**ENV, **(env or {})},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    pointer = os.path.join(out, "checkpoints", "latest")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        name = open(pointer).read().strip() if os.path.exists(pointer) else ""
        if name.startswith(f"ckpt-e{epoch:04d}-s") and not name.endswith("s0000000.pt"):
            break
        time.sleep(0.05)
    else:
        job.kill()
        raise AssertionError("no mid-epoch checkpoint appeared")
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    wait_until_gone(out)
    return name


def wait_until_gone(out, timeout=30):
    """Until no process names ``out`` on its command line: the ranks outlive a killed mpirun a
    moment, and a resume before they are gone meets their live run-directory lock."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = False
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    alive = alive or str(out).encode() in f.read()
            except OSError:  # gone meanwhile
                pass
        if not alive:
            return
        time.sleep(0.05)
    raise AssertionError(f"processes writing {out} still run {timeout} s after kill -9")


def rank_pid(marker: str, rank: int, timeout: float = 180) -> int:
    """The pid of world rank ``rank`` (Open MPI) of the job whose environment holds ``marker``
    (``NAME=VALUE``): a rank to ``kill -9`` from outside, as a node failure or the OOM killer
    would."""
    want = f"OMPI_COMM_WORLD_RANK={rank}".encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if marker.encode() in env and want in env:
                return int(pid)
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} never started")


def train_args(*extra):
    return ["-m", "mpilearn.train", "--no-progress", *extra]


def shared(tmp_path_factory, name, make):
    """The folder ``name``, filled by ``make(folder)`` once per test session and then shared,
    read-only, by every test and every pytest-xdist worker (their session fixtures are per
    worker): the first worker to ask makes it under a file lock, the others wait for it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    folder, done = root / "shared" / name, root / "shared" / f"{name}.done"
    folder.parent.mkdir(exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed attempt left
            folder.mkdir()
            make(folder)
            done.touch()  # only a complete artefact is reused
    return folder


@pytest.fixture(scope="session")
def toy_file(tmp_path_factory):
    from mpilearn.data.toy import write_regression

    folder = shared(tmp_path_factory, "data",
                    lambda f: write_regression(str(f / "toy.h5"), events=1024))
    return str(folder / "toy.h5")


@pytest.fixture(scope="session")
def toy_files(tmp_path_factory):
    """The same toy events split over three files of uneven size."""
    from mpilearn.data.toy import write_regression

    sizes = (300, 500, 224)
    folder = shared(tmp_path_factory, "split", lambda f: [
        write_regression(str(f / f"part{i}.h5"), events=n, seed=i) for i, n in enumerate(sizes)])
    return [str(folder / f"part{i}.h5") for i in range(len(sizes))]


@pytest.fixture(scope="session")
def showers_dir(tmp_path_factory):
    """160 synthetic angle-model showers, 100-200 GeV, in two files of 80."""
    from mpilearn.calo.simulate import simulate

    return shared(tmp_path_factory, "showers",
                  lambda f: simulate(str(f), 160, "angle", (100, 200), 11, 80, progress=False))


# --- markers set at collection, so that tests added later are sorted without a decorator ---

# names whose use starts a process (subprocess.run/Popen, os.system): a false hit only keeps a
# test out of `make check`
LAUNCH_NAMES = {"subprocess", "Popen", "system"}


def _starts_processes(obj, seen) -> bool:
    """Whether ``obj`` (a test, a fixture, a helper of tests/) starts a process: its code or
    that of a tests/ function or class it names uses subprocess (mpirun() does)."""
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if isinstance(obj, type):
        return any(_starts_processes(v, seen) for v in vars(obj).values()
                   if isinstance(v, types.FunctionType))
    code = getattr(obj, "__code__", None)
    if code is None or not code.co_filename.startswith(TESTS):
        return False
    codes, names = [code], set()
    while codes:  # nested functions and lambdas too
        c = codes.pop()
        names |= set(c.co_names)
        codes += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    if names & LAUNCH_NAMES:
        return True
    return any(_starts_processes(obj.__globals__[n], seen) for n in names
               if isinstance(obj.__globals__.get(n), (types.FunctionType, type)))


# tests of a cluster started by a fixture (SLURM's one-node and two-node clusters, the MPIJob
# pods): two xdist workers would each start one with the same names, ports and job ids, so
# they carry the marker ``cluster`` and `make test` runs them in a process of their own, beside
# the xdist workers (pytest-xdist 3.8's loadgroup did not keep an xdist_group on one worker here)
CLUSTER_FIXTURES = ("slurm", "nodes", "pods")


# the longest single tests (tests/DURATIONS.md): started first, so that no xdist worker
# ends the run alone with one of them while the other cores idle
LONGEST_FIRST = ("test_the_readme_runnable_blocks_run_as_written",
                 "test_compiled_and_channels_last_gan_equal_eager_at_one_and_two_ranks",
                 "test_easgd_with_one_worker_resumes_at_the_epoch_boundary_exactly",
                 "test_keras_3dgan_tapes_equal_the_fused_path_in_float64",
                 "test_the_3dgan_survives_a_kill9_equal_to_its_replay_to_float_rounding",
                 "test_a_keras_task_survives_a_kill9_equal_to_its_replay",
                 "test_a_fresh_venv_with_the_wheel_runs_the_demo_job_and_finds_the_templates",
                 "test_three_workers_reach_the_allreduce_validation_loss",
                 "test_score_mc_vs_mc_near_zero_untrained_far_worse",
                 "test_downpour_with_one_worker_equals_single_process_training",
                 "test_kill9_of_a_sweep_at_scale_then_resume",
                 "test_keras_runs_generate_alike_and_are_not_exported",
                 "test_gp_and_evolution_beat_random")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.originalname, len(rank)))  # stable
    for item in items:
        fixtures = item._fixtureinfo.name2fixturedefs
        funcs = [item.function] + [defs[-1].func for defs in fixtures.values()]
        seen = set()
        if not any(_starts_processes(f, seen) for f in funcs):
            item.add_marker(pytest.mark.unit)
        if any(name in fixtures for name in CLUSTER_FIXTURES):
            item.add_marker(pytest.mark.cluster)
