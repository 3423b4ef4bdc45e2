"""Render time: what a job would refuse when it starts, refused before it is submitted
(``python -m mpilearn.jobs``, for SLURM and Kubernetes alike): the model and its
hyperparameters (as ``train``/``optimize`` check them, reading no data), the data paths as
the job will see them, and the ranks against the GPUs.

A bad input found here is exit 2 on the login node, instead of a job that waits in a queue,
starts its pods or nodes, and then exits 2 (and, on Kubernetes, may be retried).
"""
from __future__ import annotations

import glob
import os
from typing import List

from ..errors import UsageError

DATA_KEYS = ("data.files", "data.val_files", "data.test_files")


def check_config(kind: str, config: dict) -> None:
    """The model file (it imports, it has its builder) and the hyperparameters it declares; a
    sweep's space, searcher, objective and pruner. Raises the first UsageError, as the job's
    rank 0 would. The model is not built here: a builder may need the job's MPI context."""
    if kind == "hpo":
        from ..hpo.optimize import check_search

        check_search(config, build=False)
        return
    from ..core.builders import load_builder
    from ..train.checks import check_hparams

    load_builder(config["model"])
    check_hparams(config["model"], config["hparams"])


def data_paths(kind: str, config: dict) -> List[tuple]:
    """(key, path or pattern) of every data file the job reads."""
    keys = DATA_KEYS + (("search.test_files",) if kind == "hpo" else ())
    out = []
    for key in keys:
        section, name = key.split(".")
        out += [(key, p) for p in config.get(section, {}).get(name, []) or []]
    return out


def check_pod_paths(kind: str, config: dict, kube: dict, source: str) -> None:
    """On Kubernetes the pods see the data volume at <workdir>/data and the runs volume at
    <workdir>/runs, nothing of the checkout: a data path elsewhere would be missing there."""
    workdir = kube["workdir"].rstrip("/")
    for key, path in data_paths(kind, config):
        inside = os.path.normpath(path if os.path.isabs(path) else os.path.join(workdir, path))
        volume = next((v for v in ("data", "runs")
                       if inside == f"{workdir}/{v}" or inside.startswith(f"{workdir}/{v}/")), None)
        if volume is None:
            raise UsageError(
                f"{key}: {path} is not on a volume the pods mount: they see {workdir}/data (the "
                f"data PVC, '{kube['data_pvc'] or 'none'}') and {workdir}/runs; put the files on "
                f"the data volume and name them data/... (relative to {workdir})")
        if volume == "data" and not kube["data_pvc"]:
            raise UsageError(
                f"{key}: {path} is on the data volume, but {source} sets no "
                "'kubernetes.data_pvc': the pods' data/ is an empty directory")


def missing_here(kind: str, config: dict) -> List[str]:
    """SLURM reads the data from the shared file system, relative to the directory sbatch runs
    in: the patterns that match nothing from here (a warning: the files may come later)."""
    return [f"{key}: {path}" for key, path in data_paths(kind, config)
            if not glob.glob(path)]


def check_slots(per_node: int, gpus: int, config: dict, names: tuple) -> None:
    """One rank per GPU whenever GPUs are asked for: more ranks than GPUs share them (train
    refuses that unless device.allow_shared_gpus), fewer leave GPUs idle that are paid for.
    ``names``: how the two values are called where they came from."""
    device = config.get("device", {})
    if device.get("type") == "cuda" and not gpus:
        raise UsageError(f"device.type is cuda but the job asks for no GPU ({names[1]} is 0): "
                         f"set {names[1]}, or device.type auto")
    if not gpus or not per_node or per_node == gpus:
        return
    if per_node > gpus and device.get("allow_shared_gpus"):
        return
    why = ("the ranks would share GPUs, which the run refuses unless device.allow_shared_gpus "
           "is true" if per_node > gpus else f"{gpus - per_node} GPU(s) per node would stay idle")
    raise UsageError(f"{names[0]} {per_node} with {names[1]} {gpus}: mpilearn runs one rank per "
                     f"GPU and {why}; leave {names[0]} at 0 (one rank per GPU) or make the two "
                     "equal")
