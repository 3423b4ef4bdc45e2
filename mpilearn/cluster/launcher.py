"""Which launcher started this process, read from its environment before MPI starts.

Detection order (the first that matches wins):

1. Open MPI ``mpirun``/``mpiexec`` (also inside a SLURM allocation): ``OMPI_COMM_WORLD_RANK``,
   ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``.
2. MPICH / Intel MPI Hydra ``mpiexec``: ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``,
   ``MPI_LOCALNRANKS``.
3. ``torchrun`` (torch.distributed.run): ``TORCHELASTIC_RUN_ID`` with ``RANK``,
   ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``. It starts processes but no MPI, so
   every process is a world of one: refused with the command to use instead.
4. SLURM ``srun`` (PMI-2 or PMIx): ``SLURM_STEP_ID`` with ``SLURM_PROCID``,
   ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID`` and this node's entry of
   ``SLURM_STEP_TASKS_PER_NODE``.
5. Another PMIx launcher: ``PMIX_RANK``.
6. None: one process (MPI starts as a singleton).

The MPI launchers come before SLURM because ``mpirun`` inside an allocation inherits the
batch step's ``SLURM_*`` variables, which describe the allocation, not this process.
MPI itself stays the authority on rank and size; :func:`check` turns the classic mismatch
(every process a rank 0 of 1, because mpi4py's MPI is not the launcher's) into a clear error.
The node-local rank comes from a shared-memory split of the communicator (see ``comm``),
which agrees with the launcher's wherever both exist.
"""
from __future__ import annotations

import argparse
import os
import re
import time
from dataclasses import dataclass
from typing import Mapping, Optional

from ..errors import UsageError


@dataclass(frozen=True)
class Launch:
    name: str           # "none", "mpirun", "hydra", "torchrun", "srun", "pmix"
    rank: int
    size: Optional[int]  # None where the launcher does not say (bare PMIx)
    local_rank: Optional[int] = None
    local_size: Optional[int] = None

    def describe(self) -> str:
        extra = f" (SLURM job {os.environ['SLURM_JOB_ID']})" if "SLURM_JOB_ID" in os.environ else ""
        job = mpijob_name()
        if job:  # the MPI Operator's launcher started it
            return (f"{self.name} (MPIJob {job}), "
                    f"{self.size if self.size is not None else '?'} process(es)")
        return f"{self.name}, {self.size if self.size is not None else '?'} process(es){extra}"


# where the MPI Operator's launcher finds its host file (Open MPI, MPICH Hydra, Intel MPI);
# MPILEARN_HOSTFILE: the copy that mpilearn's launcher script writes and forwards to the ranks
HOSTFILE_VARS = ("MPILEARN_HOSTFILE", "OMPI_MCA_orte_default_hostfile", "HYDRA_HOST_FILE",
                 "I_MPI_HYDRA_HOST_FILE")


def operator_hostfile(env: Mapping[str, str] = os.environ) -> Optional[str]:
    return next((env[k] for k in HOSTFILE_VARS[1:] if env.get(k)), None)


def mpijob_name(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """The MPIJob this process belongs to, or None outside one: K_MPI_JOB_ROLE is set by the
    operator, and its host file names the workers ``NAME-worker-I.NAME.NAMESPACE.svc``."""
    if not env.get("K_MPI_JOB_ROLE"):
        return None
    path = next((env[k] for k in HOSTFILE_VARS if env.get(k)), None)
    try:
        with open(path) as f:
            host = next(line.split()[0] for line in f if line.split())
    except (TypeError, OSError, StopIteration):
        return "?"
    host = host.split(":")[0]
    labels = host.split(".")
    return labels[1] if len(labels) > 1 else re.sub(r"-(worker-\d+|launcher)$", "", host)


def _int(env: Mapping[str, str], key: str) -> Optional[int]:
    value = env.get(key)
    return int(value) if value not in (None, "") else None


def tasks_per_node(spec: str) -> list:
    """A SLURM tasks-per-node list such as ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ValueError(f"cannot read SLURM tasks-per-node list {spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def tasks_on_node(spec: str, node: int) -> int:
    """This node's entry of a SLURM tasks-per-node list such as ``2(x3),1``."""
    return tasks_per_node(spec)[node]


def detect(env: Mapping[str, str] = os.environ) -> Launch:
    if "OMPI_COMM_WORLD_RANK" in env:
        return Launch("mpirun", _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE"),
                      _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"))
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        return Launch("hydra", _int(env, "PMI_RANK"), _int(env, "PMI_SIZE"),
                      _int(env, "MPI_LOCALRANKID"), _int(env, "MPI_LOCALNRANKS"))
    if "TORCHELASTIC_RUN_ID" in env and "RANK" in env:
        return Launch("torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE"),
                      _int(env, "LOCAL_RANK"), _int(env, "LOCAL_WORLD_SIZE"))
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        local_size = None
        if "SLURM_STEP_TASKS_PER_NODE" in env and "SLURM_NODEID" in env:
            local_size = tasks_on_node(env["SLURM_STEP_TASKS_PER_NODE"], int(env["SLURM_NODEID"]))
        size = _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS")
        return Launch("srun", _int(env, "SLURM_PROCID"), size, _int(env, "SLURM_LOCALID"), local_size)
    if "PMIX_RANK" in env:
        return Launch("pmix", _int(env, "PMIX_RANK"), None)
    return Launch("none", 0, 1, 0, 1)


def mismatch(launch: Launch, mpi_size: int) -> Optional[str]:
    """The error when the launcher started N processes but MPI sees a world of 1, else None."""
    if not (launch.size and launch.size > 1 and mpi_size == 1):
        return None
    if launch.name == "torchrun":
        return (f"torchrun started {launch.size} processes, but mpilearn runs on MPI and torchrun "
                "starts none, so each process would be a separate one-rank job writing into the "
                f"same place: launch with mpirun -np {launch.size} (or srun, or "
                f"mpilearn-run -np {launch.size}) instead of torchrun --nproc_per_node")
    fix = {"srun": "launch with srun --mpi=pmix (or pmi2; see srun --mpi=list), or build "
                   "mpi4py against the site MPI",
           "hydra": "use the mpiexec of the MPI that mpi4py was built against",
           "mpirun": "use the mpirun of the MPI that mpi4py was built against"}
    return (f"{launch.name} started {launch.size} processes but MPI sees a world of 1 in each "
            f"(process {launch.rank}): mpi4py's MPI library is not the one the launcher speaks "
            f"to; {fix.get(launch.name, 'check the launcher')}. "
            "python -c 'import mpi4py.MPI as M; print(M.Get_library_version())' shows which MPI "
            "mpi4py uses")


def check(launch: Launch, mpi_rank: int, mpi_size: int) -> None:
    """Raise UsageError when the launcher started N processes but MPI sees a world of 1."""
    message = mismatch(launch, mpi_size)
    if message is not None:
        # every process is a rank 0 now: only the launcher's first one speaks
        raise UsageError(message, quiet=bool(launch.rank))
    if launch.size and launch.size == mpi_size and launch.rank != mpi_rank:
        # harmless for training, but worth knowing when reading per-rank logs
        print(f"mpilearn: note: launcher rank {launch.rank} is MPI rank {mpi_rank}", flush=True)


class RankZeroArgumentParser(argparse.ArgumentParser):
    """Every rank parses its arguments before MPI starts; only the launcher's first process
    prints usage, help and errors (the exit status is the same everywhere)."""

    def _print_message(self, message, file=None):
        if not detect().rank:
            super()._print_message(message, file)

    def exit(self, status=0, message=None):
        if status and detect().rank:
            # mpirun ends the job at the first process that fails: let the first one print
            # its message and fail first, or the message can be lost with it
            time.sleep(2.0)
        super().exit(status, message)
