"""Staging: node-local copies of the data files, as a transport detail of a batch job.

The batch script copies every data file to ``$MPILEARN_STAGE/<absolute source path>`` on each
node (:func:`stage`) and exports ``MPILEARN_STAGE``; readers open :func:`local` of a source
path. The run's identity (its config, the resume check, messages) keeps the source paths, so
the links of a chain, each with its own stage directory, are one run. Mirroring the absolute
path keeps two sources with the same file name apart.
"""
from __future__ import annotations

import os
import shutil
from typing import Iterable

ENV = "MPILEARN_STAGE"


def staged_path(stage_dir: str, path: str) -> str:
    return os.path.join(stage_dir, os.path.abspath(path).lstrip(os.sep))


def local(path: str) -> str:
    """The node-local copy of ``path`` when this job staged it, else ``path`` itself."""
    stage_dir = os.environ.get(ENV)
    if not stage_dir:
        return path
    copy = staged_path(stage_dir, path)
    return copy if os.path.isfile(copy) else path


def stage(paths: Iterable[str], stage_dir: str) -> tuple:
    """Copy ``paths`` under ``stage_dir`` (each file whole or not at all: a copy is renamed
    into place when complete). Returns (files, bytes) copied; present copies are kept."""
    files = size = 0
    for path in dict.fromkeys(os.path.abspath(p) for p in paths):
        target = staged_path(stage_dir, path)
        if os.path.isfile(target) and os.path.getsize(target) == os.path.getsize(path):
            continue  # a requeued job on the same node: staged already
        os.makedirs(os.path.dirname(target), exist_ok=True)
        part = f"{target}.part-{os.getpid()}"
        shutil.copyfile(path, part)
        os.replace(part, target)
        files, size = files + 1, size + os.path.getsize(target)
    return files, size


PREFIX = "mpilearn-"  # a stage directory is <stage_to>/mpilearn-<SLURM job id>


def leave_on_exit(local_rank: int) -> None:
    """Node-local rank 0 removes its node's stage when its process ends, whatever ended the
    job (the batch script's own clean-up needs ``srun``, which a cancelled job cannot run)."""
    import atexit

    stage_dir = os.environ.get(ENV)
    if stage_dir and local_rank == 0 and os.path.basename(stage_dir).startswith(PREFIX):
        atexit.register(shutil.rmtree, stage_dir, True)


def remove_left_behind(stage_dir: str) -> list:
    """The stages beside ``stage_dir`` whose SLURM jobs no longer run (a node failure or a
    SIGKILL left them): removed. Returns their paths."""
    import glob

    from . import slurmjob

    removed = []
    mine = os.path.basename(os.path.normpath(stage_dir))
    for path in glob.glob(os.path.join(os.path.dirname(os.path.normpath(stage_dir)), PREFIX + "*")):
        job = os.path.basename(path)[len(PREFIX):]
        if os.path.basename(path) == mine or not job.isdigit() or not os.path.isdir(path):
            continue
        if os.stat(path).st_uid == os.getuid() and slurmjob.running(job) is False:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
