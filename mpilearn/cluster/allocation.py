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


def describe(alloc: dict) -> str:
    gpus = f", {alloc['gpus']} GPU(s) per node" if alloc["gpus"] else ""
    return (f"{alloc['ntasks']} task(s) on {len(alloc['hosts'])} node(s) (tasks per node: "
            f"{','.join(map(str, alloc['slots']))}{gpus})")


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
    alloc = allocation(env)
    note = None
    if kind == "hpo":
        blocks, width = config["search"]["blocks"], sweep_width(config)
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
                if n and launcher == "mpirun":
                    f.write(f"{host} slots={n}\n")
                elif n:
                    f.write(f"{host}\n" * n)
    return sum(counts), note
