"""Launcher detection: the documented order, and real launches under each launcher here
(none, Open MPI mpirun, MPICH Hydra mpiexec; srun is in test_slurm.py)."""
import os
import subprocess
import sys

import pytest

from conftest import ENV, REPO, mpirun_cmd, train_args
from mpilearn.cluster.launcher import detect, tasks_on_node

MPICH = os.path.join(REPO, ".venv", "mpich")
# a SLURM batch step: what mpirun inside an allocation inherits
BATCH = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0",
         "SLURM_NODEID": "0"}


def test_detection_order():
    ompi = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    m = detect({**BATCH, **ompi})  # mpirun wins over the allocation's SLURM_*
    assert (m.name, m.rank, m.size, m.local_rank, m.local_size) == ("mpirun", 5, 8, 1, 4)
    hydra = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    h = detect({**BATCH, **hydra})
    assert (h.name, h.rank, h.size, h.local_rank, h.local_size) == ("hydra", 3, 4, 1, 2)
    srun = {**BATCH, "SLURM_STEP_ID": "0", "SLURM_PROCID": "6", "SLURM_STEP_NUM_TASKS": "7",
            "SLURM_LOCALID": "2", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4,3",
            "PMIX_RANK": "6"}
    s = detect(srun)
    assert (s.name, s.rank, s.size, s.local_rank, s.local_size) == ("srun", 6, 7, 2, 3)
    assert detect(BATCH).name == "none"  # a plain python in a batch script is one process
    assert detect({"PMIX_RANK": "2"}).name == "pmix"
    assert tasks_on_node("2(x3),1", 3) == 1 and tasks_on_node("4", 0) == 4


def run_training(launch, toy_file, out, env):
    args = train_args("--set", f"model={REPO}/models/mlp.py", "--set", f"data.files=[{toy_file}]",
                      "--set", "train.max_steps_per_epoch=2", "--output", str(out))
    return subprocess.run(launch + [sys.executable] + args, capture_output=True, text=True,
                          cwd=REPO, env={**ENV, **env}, timeout=300)


def test_no_launcher_and_mpirun(toy_file, tmp_path):
    alone = run_training([], toy_file, tmp_path / "run", {})
    assert alone.returncode == 0, alone.stderr
    assert "launcher none, 1 process(es); 1 rank(s) on this node" in alone.stdout
    proc = run_training(mpirun_cmd(2, [])[:-1], toy_file, tmp_path / "mpirun", {})
    assert proc.returncode == 0, proc.stderr
    assert "launcher mpirun, 2 process(es); 2 rank(s) on this node" in proc.stdout


@pytest.fixture(scope="module")
def hydra():
    mpiexec = os.path.join(MPICH, "bin", "mpiexec.hydra")
    if not os.path.exists(mpiexec):
        pytest.fail(f"{mpiexec} missing: `make test` installs MPICH's Hydra (make {MPICH}/.installed)")
    return [mpiexec, "-n", "2"], {"LD_LIBRARY_PATH": os.path.join(MPICH, "lib")}


def test_mpich_hydra(hydra, toy_file, tmp_path):
    launch, env = hydra
    proc = run_training(launch, toy_file, tmp_path / "run", {**env, "MPI4PY_MPIABI": "mpich"})
    assert proc.returncode == 0, proc.stderr
    assert "launcher hydra, 2 process(es); 2 rank(s) on this node" in proc.stdout


def test_an_mpi_that_is_not_the_launchers_is_a_clear_error(hydra, toy_file, tmp_path):
    # Hydra starts two processes, but mpi4py speaks Open MPI: each would be a lone rank 0
    launch, _ = hydra
    proc = run_training(launch, toy_file, tmp_path / "run", {})  # mpi4py finds the venv's Open MPI
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("hydra started 2 processes but MPI sees a world of 1") == 1
    assert "use the mpiexec of the MPI that mpi4py was built against" in proc.stderr
    assert not os.path.exists(tmp_path / "run")  # before any work
