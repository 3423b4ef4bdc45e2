"""Running one fold of one trial, and reading its objective.

The objective is minimised. Either a metric the training logs (``metric``, with ``mode``
final or best) — validation loss, any logged metric, or the physics ``score`` — or a plain
Python function of the parameters (``function: module:func`` or ``file.py:func``), for
searches with no training at all.
"""
from __future__ import annotations

import math
import os
import time
import traceback
from typing import Optional

import numpy as np

from .. import preempt
from ..comm import UsageError
from ..models import load_builder
from .space import apply


def parse(config: dict) -> dict:
    obj = dict(config["search"]["objective"] or {"metric": "val_loss"})
    unknown = set(obj) - {"metric", "mode", "function"}
    if unknown:
        raise UsageError(f"search.objective: unknown field(s) {', '.join(sorted(unknown))}")
    if "function" in obj:
        obj["callable"] = load_builder(obj["function"] if ":" in obj["function"] else obj["function"] + ":objective")
        return obj
    obj.setdefault("metric", "val_loss")
    obj.setdefault("mode", "final")
    if obj["mode"] not in ("final", "best"):
        raise UsageError(f"search.objective.mode is {obj['mode']!r}; choose final or best")
    return obj


def fold_events(n: int, folds: int, fold: int, seed: int, val_fraction: float):
    """Event-level k-fold split of the training events (deterministic given the seed)."""
    perm = np.random.default_rng([seed, 31337]).permutation(n)
    if folds == 1:
        n_val = max(1, int(round(n * val_fraction)))
        return np.sort(perm[n_val:]), np.sort(perm[:n_val])
    parts = np.array_split(perm, folds)
    val = parts[fold]
    train = np.concatenate([p for i, p in enumerate(parts) if i != fold])
    return np.sort(train), np.sort(val)


def value_of(history: list, obj: dict) -> float:
    values = [r[obj["metric"]] for r in history if r.get(obj["metric"]) is not None]
    if not values:
        raise RuntimeError(f"metric '{obj['metric']}' was never logged")
    return float(values[-1] if obj["mode"] == "final" else min(values))


def run_fold(config: dict, point: dict, fold: int, ctx, output: str, obj: dict,
             n_events: Optional[int], on_epoch=None) -> dict:
    """Collective over ``ctx.comm``: trains one fold; never raises for a failed trial.

    A fold that a stop signal interrupted returns status ``interrupted``; run again, it
    continues from its own checkpoint."""
    start = time.time()
    search = config["search"]
    try:
        if "callable" in obj:
            value = obj["callable"](dict(point)) if ctx.rank == 0 else None
            value = float(ctx.comm.bcast(value, root=0))
        else:
            from ..train.engine import Trainer

            trial = dict(config)
            trial["hparams"] = apply(config["hparams"], point)
            events = fold_events(n_events, search["folds"], fold, search["seed"],
                                 config["data"]["val_fraction"] or 0.2)
            deadline = start + search["trial_timeout"] if search["trial_timeout"] > 0 else None
            resume = ctx.comm.bcast(os.path.isdir(os.path.join(output, "checkpoints")), root=0)
            trainer = Trainer(trial, ctx, output=output, progress=False, events=events,
                              deadline=deadline, resume="auto" if resume else False)
            trainer.on_epoch = on_epoch
            trainer.fit()
            value = value_of(trainer.history, obj)
        if not math.isfinite(value):
            return {"status": "failed", "reason": f"objective is {value}", "wall": time.time() - start}
        return {"status": "done", "value": value, "wall": time.time() - start}
    except preempt.Preempted:
        return {"status": "interrupted", "wall": time.time() - start}
    except (Exception, SystemExit) as err:  # a failed trial is recorded, the sweep goes on
        reason = f"{type(err).__name__}: {err}"
        if not isinstance(err, (UsageError, SystemExit)) and type(err).__name__ != "TrainingStopped":
            reason += "\n" + "".join(traceback.format_exception(err)[-3:])
        return {"status": "failed", "reason": reason.strip(), "wall": time.time() - start}
