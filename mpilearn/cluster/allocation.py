"""What a batch script does at job start with the allocation SLURM gave it (not the one it
was rendered for): how many ranks to launch and on which nodes, and whether a sweep's layout
fits. ``python -m mpilearn.jobs --plan`` prints the rank count and writes the host file.
"""
from __future__ import annotations

import os
import re
import subprocess
from typing import List, Mapping, Optional

from ..errors import UsageError
from ..hpo.layout import sweep_width
from .launcher import tasks_per_node


def _gpus(env: Mapping[str, str]) -> int:
    """GPUs per node: SLURM_GPUS_ON_NODE, else the count of SLURM_GPUS_PER_NODE ('a100:4')."""
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        m = re.search(r"(\d+)$", env.get(key, "") or "")
        if m:
            return int(m.group(1))
    return 0


def hostnames(nodelist: str) -> List[str]:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise UsageError(f"scontrol show hostnames {nodelist} failed: {out.stderr.strip()}")
    return out.stdout.split()


def allocation(env: Mapping[str, str] = os.environ) -> dict:
    """The job's nodes, task slots per node and GPUs per node, from SLURM's variables."""
    if "SLURM_NTASKS" not in env or "SLURM_JOB_NODELIST" not in env:
        raise UsageError("not inside a SLURM allocation (SLURM_NTASKS and SLURM_JOB_NODELIST "
                         "unset): submit the script with sbatch")
    hosts = hostnames(env["SLURM_JOB_NODELIST"])
    slots = tasks_per_node(env.get("SLURM_TASKS_PER_NODE") or env["SLURM_NTASKS"])
    if len(slots) != len(hosts):
        raise UsageError(f"SLURM_TASKS_PER_NODE={env.get('SLURM_TASKS_PER_NODE')} does not "
                         f"match the {len(hosts)} node(s) of {env['SLURM_JOB_NODELIST']}")
    # sbatch --ntasks=3 under a '#SBATCH --ntasks-per-node=5' line reserves 5 slots, 3 tasks
    ntasks, capped = int(env["SLURM_NTASKS"]), []
    for n in slots:
        capped.append(min(n, ntasks - sum(capped)))
    return {"ntasks": ntasks, "hosts": hosts, "slots": capped, "gpus": _gpus(env)}


def mpijob_allocation(env: Mapping[str, str] = os.environ) -> dict:
    """An MPIJob's workers and slots, from the host file the MPI Operator mounts in the
    launcher pod (``host slots=N`` for Open MPI, ``host:N`` for Hydra). The launcher pod sees
    no GPU: the rendered manifest passes the workers' count as MPILEARN_GPUS_PER_WORKER."""
    from .launcher import operator_hostfile
    from .run import read_hostfile

    path = operator_hostfile(env)
    if not path:
        raise UsageError("K_MPI_JOB_ROLE=launcher but no host file variable is set "
                         "(OMPI_MCA_orte_default_hostfile, HYDRA_HOST_FILE or "
                         "I_MPI_HYDRA_HOST_FILE): is this an MPI Operator launcher pod?")
    try:
        hosts = read_hostfile(path)
    except (OSError, ValueError) as err:
        raise UsageError(f"the MPI Operator's host file {path}: {err}") from None
    gpus = int(env.get("MPILEARN_GPUS_PER_WORKER") or 0)
    return {"ntasks": sum(n for _, n in hosts), "hosts": [h for h, _ in hosts],
            "slots": [n for _, n in hosts], "gpus": gpus,
            "hydra": "OMPI_MCA_orte_default_hostfile" not in env}


def describe(alloc: dict) -> str:
    gpus = f", {alloc['gpus']} GPU(s) per node" if alloc["gpus"] else ""
    return (f"{alloc['ntasks']} task(s) on {len(alloc['hosts'])} node(s) (tasks per node: "
            f"{','.join(map(str, alloc['slots']))}{gpus})")


def coordinator_first(alloc: dict) -> dict:
    """The allocation with its roomiest node first (stable: equal nodes keep their order). A
    sweep's header asks --ntasks with --ntasks-per-node as a maximum, so one node holds the
    coordinator's extra task; SLURM may list it anywhere, and the coordinator (rank 0, the
    host file's first line) must go there."""
    order = sorted(range(len(alloc["hosts"])), key=lambda i: -alloc["slots"][i])
    return {**alloc, "hosts": [alloc["hosts"][i] for i in order],
            "slots": [alloc["slots"][i] for i in order]}


def place_sweep(alloc: dict, blocks: int, width: int, config_path: str) -> List[int]:
    """Ranks per node for a sweep: the coordinator first on node 0, then the training ranks
    (at most one per GPU) in node order. A layout that does not fit is refused, naming both."""
    workers, counts = blocks * width, []
    left = workers
    for i, slots in enumerate(alloc["slots"]):
        room = slots - (i == 0)
        if alloc["gpus"]:
            room = min(room, alloc["gpus"])
        take = max(0, min(room, left))
        left -= take
        counts.append(take + (i == 0))
    if left:
        fit = (workers - left) // width
        hint = f", or --set search.blocks={fit}" if fit else ""
        raise UsageError(
            f"the sweep in {config_path} needs {1 + workers} task(s) (1 coordinator + {blocks} "
            f"block(s) x {width} rank(s) per trial{', one GPU each' if alloc['gpus'] else ''}) "
            f"but the allocation has {describe(alloc)}: submit with sbatch --ntasks="
            f"{1 + workers}{' and enough GPUs' if alloc['gpus'] else ''}{hint}")
    return counts


def plan(kind: str, config: dict, config_path: str, launcher: str,
         hostfile: Optional[str], env: Mapping[str, str] = os.environ) -> tuple:
    """(ranks to launch, note or None); writes ``hostfile`` where the launch needs one: an
    mpirun host file, or srun's one line per task (SLURM_HOSTFILE, --distribution=arbitrary)."""
    mpijob = env.get("K_MPI_JOB_ROLE") == "launcher"
    alloc = mpijob_allocation(env) if mpijob else allocation(env)
    note = None
    if kind == "hpo":
        blocks, width = config["search"]["blocks"], sweep_width(config)
        if mpijob:  # the coordinator: one extra rank on the first worker (no GPU)
            alloc["slots"][0] += 1
            alloc["ntasks"] += 1
        else:
            alloc = coordinator_first(alloc)
        counts = place_sweep(alloc, blocks, width, config_path)
        if sum(counts) < alloc["ntasks"]:
            placed = ", ".join(f"{h} x{n}" for h, n in zip(alloc["hosts"], counts) if n)
            note = (f"mpilearn: the sweep uses {sum(counts)} of the allocation's "
                    f"{describe(alloc)}; ranks placed: {placed}")
    else:
        counts = alloc["slots"]
    if hostfile and (kind == "hpo" or launcher == "mpirun"):
        with open(hostfile, "w") as f:
            for host, n in zip(alloc["hosts"], counts):
                if n and alloc.get("hydra"):
                    f.write(f"{host}:{n}\n")
                elif n and launcher == "mpirun":
                    f.write(f"{host} slots={n}\n")
                elif n:
                    f.write(f"{host}\n" * n)
    return sum(counts), note
