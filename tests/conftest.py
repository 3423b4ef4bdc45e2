"""Shared helpers: real mpirun launches (never a mocked MPI), toy data files."""
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")
ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
       "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}


def mpirun_cmd(np_, args):
    return ["mpirun", "-np", str(np_), "--oversubscribe", sys.executable] + list(args)


PMIX_START_FAILURE = "PMIx server's listener thread failed to start"


def mpirun(np_, args, timeout=300, cwd=None, env=None):
    """Run ``python ARGS`` on np_ ranks; returns CompletedProcess (text)."""
    start = time.monotonic()
    for attempt in range(2):
        proc = subprocess.run(mpirun_cmd(np_, args), capture_output=True, text=True,
                              timeout=timeout, cwd=cwd or REPO, env={**ENV, **(env or {})})
        # Open MPI's launcher sometimes fails to start on a loaded machine, before any rank
        # runs: only that is run again
        if PMIX_START_FAILURE not in proc.stderr:
            break
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
    return name


def train_args(*extra):
    return ["-m", "mpilearn.train", "--no-progress", *extra]


@pytest.fixture(scope="session")
def toy_file(tmp_path_factory):
    from mpilearn.data.toy import write_regression

    return write_regression(str(tmp_path_factory.mktemp("data") / "toy.h5"), events=1024)


@pytest.fixture(scope="session")
def toy_files(tmp_path_factory):
    """The same toy events split over three files of uneven size."""
    from mpilearn.data.toy import write_regression

    folder = tmp_path_factory.mktemp("split")
    return [write_regression(str(folder / f"part{i}.h5"), events=n, seed=i)
            for i, n in enumerate((300, 500, 224))]


@pytest.fixture(scope="session")
def showers_dir(tmp_path_factory):
    """160 synthetic angle-model showers, 100-200 GeV, in two files of 80."""
    from mpilearn.calo.simulate import simulate

    folder = tmp_path_factory.mktemp("showers")
    simulate(str(folder), 160, "angle", (100, 200), 11, 80, progress=False)
    return folder
