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
