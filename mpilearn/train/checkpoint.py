"""Checkpoints: one file per save, written atomically by rank 0, a ``latest`` pointer, pruning.

A checkpoint holds the task (all models and optimizers), the position (epoch, step in epoch,
global step), every rank's RNG states, and the engine's running state (epoch accumulators,
early-stopping state), so a resumed run continues exactly where the killed one stopped. It
holds tensors and plain types only: ``torch.load(path, weights_only=True)`` reads it.
"""
from __future__ import annotations

import glob
import os
import random
from typing import Optional

import numpy as np
import torch

from ..core.io import atomic_write_bytes, atomic_write_text

LATEST = "latest"


def rng_state(task=None) -> dict:
    """This process's RNG states as tensors and plain types (``torch.load(weights_only=True)``
    refuses numpy arrays); with ``task``, its own streams too (Keras's seed generators)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                       "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
             "python": random.getstate(),
             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    streams = task.rng_state() if task is not None else None
    if streams is not None:
        state["task"] = streams
    return state


def set_rng_state(state: dict, task=None) -> None:
    if task is not None and state.get("task") is not None:
        task.set_rng_state(state["task"])
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    if isinstance(n, dict):
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                             n["has_gauss"], n["cached"]))
    else:  # checkpoints written before the RNG state became tensors
        np.random.set_state(n)
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def name_for(epoch: int, step: int) -> str:
    return f"ckpt-e{epoch:04d}-s{step:07d}.pt"


def save(folder: str, name: str, state: dict, keep: int = 3) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    atomic_write_bytes(path, lambda f: torch.save(state, f))
    atomic_write_text(os.path.join(folder, LATEST), name + "\n")
    if keep > 0:
        for old in sorted(glob.glob(os.path.join(folder, "ckpt-*.pt")))[:-keep]:
            os.unlink(old)
    return path


def latest(folder: str) -> Optional[str]:
    pointer = os.path.join(folder, LATEST)
    if os.path.exists(pointer):
        with open(pointer) as f:
            path = os.path.join(folder, f.read().strip())
        if os.path.exists(path):
            return path
    found = sorted(glob.glob(os.path.join(folder, "ckpt-*.pt")))
    return found[-1] if found else None


def load(path: str) -> dict:
    """Tensors and plain types only; checkpoints from before that need the full unpickler."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        return torch.load(path, map_location="cpu", weights_only=False)


def candidates(folder: str) -> list:
    """The checkpoint ``latest`` points at, then every other one, newest first."""
    first = latest(folder)
    rest = sorted(glob.glob(os.path.join(folder, "ckpt-*.pt")), reverse=True)
    return ([first] if first else []) + [p for p in rest if p != first]


def load_newest(folder: str):
    """(path, state, [(path, error) of newer checkpoints that did not load]); path is None when
    no checkpoint loads. A truncated or corrupt ``latest`` falls back to an older one."""
    failed = []
    for path in candidates(folder):
        try:
            return path, load(path), failed
        except Exception as err:  # truncated zip, unpickling error, ...
            failed.append((path, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"))
    return None, None, failed
