"""Monitored metrics: which way each improves, and keeping the best checkpoint (``train.best``,
tracked by ``callbacks.BestCheckpoint``).

``mode`` is ``min`` or ``max``. It is inferred for the metrics the project itself logs (losses
and errors: min; accuracies: max; the physics numbers a callback declares) and must be given
for any other; early stopping and the best checkpoint read it the same way. An epoch whose
record lacks the monitored metric (physics validated every N epochs only) is skipped.

The best checkpoint is ``checkpoints/best.pt``: a copy of the epoch's full checkpoint (model,
optimizer, position, RNGs, this tracker's best value), never pruned by
``train.keep_checkpoints``; ``models/best/`` holds its models exported as ``models/`` holds the
last epoch's, with ``best.json`` saying which epoch and value.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from ..errors import UsageError
from ..core.io import atomic_write_bytes, atomic_write_text

MODES = ("min", "max")
BEST = "best.pt"


def inferred_mode(name: str) -> Optional[str]:
    """The direction of a metric the engine logs (``train_``/``val_``/``test_`` + the task's
    loss and metric names), from its name; None where the name does not tell."""
    base = name.split("_", 1)[1] if name.startswith(("train_", "val_", "test_")) else name
    if base == "loss" or base.endswith("_loss") or base in ("mae", "mse", "rmse", "mape"):
        return "min"
    if base in ("acc", "accuracy") or base.endswith(("_acc", "_accuracy")):
        return "max"
    return None


def resolve(section: str, monitor: str, mode: str, known: dict) -> str:
    """``mode`` if given, else the known direction of ``monitor``; UsageError names the key."""
    if mode:
        if mode not in MODES:
            raise UsageError(f"train.{section}.mode is {mode!r}; choose min or max")
        return mode
    if monitor not in known:
        raise UsageError(f"train.{section}.mode is needed for monitor '{monitor}' (min or max): "
                         "the direction is inferred only for "
                         f"{', '.join(sorted(known)) or 'no metric of this run'}")
    return known[monitor]


def improved(value, best, mode: str, min_delta: float = 0.0) -> bool:
    """``value`` beats ``best`` (None: nothing yet) by more than ``min_delta``."""
    if value is None or value != value:  # absent or NaN never improves
        return False
    if best is None:
        return True
    return value < best - min_delta if mode == "min" else value > best + min_delta


def keep_if_improved(task, output: str, checkpoint: Optional[str], callbacks) -> None:
    """After an epoch's checkpoint was written (``checkpoint``: its path on rank 0, None
    elsewhere): :func:`keep` it if the best-checkpoint tracker saw an improvement."""
    tracker = next((cb for cb in callbacks if cb.name == "best"), None)
    if checkpoint and tracker is not None and tracker.improved:
        keep(task, output, checkpoint, tracker)


def keep(task, output: str, checkpoint: str, tracker) -> None:
    """Rank 0, after an improving epoch was checkpointed: ``checkpoints/best.pt`` becomes a
    copy of ``checkpoint`` (atomically) and ``models/best/`` its export (swapped in whole)."""
    folder = os.path.dirname(checkpoint)
    with open(checkpoint, "rb") as src:
        atomic_write_bytes(os.path.join(folder, BEST), lambda f: shutil.copyfileobj(src, f))
    final = os.path.join(output, "models", "best")
    tmp, old = final + ".partial", final + ".old"
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    task.export(tmp)
    atomic_write_text(os.path.join(tmp, "best.json"), json.dumps(
        {**tracker.state_dict(), "checkpoint": os.path.join("checkpoints", BEST)}, indent=1))
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
