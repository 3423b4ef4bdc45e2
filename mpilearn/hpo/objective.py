"""Running one fold of one trial, and reading its objective.

The objective is minimised. Either a metric the training logs (``metric``, with ``mode``
final or best) — validation loss, any logged metric, or the physics ``score`` — or a plain
Python function of the parameters (``function: module:func`` or ``file.py:func``), for
searches with no training at all.
"""
from __future__ import annotations

import contextlib
import errno
import math
import sys
import time
import traceback
from typing import Optional

import numpy as np

from ..cluster import preempt
from ..errors import TrainingStopped, UsageError
from ..core.builders import default_hparams, load_builder
from .space import apply


DIRECTIONS = ("minimize", "maximize")
PRUNE_KEY = "_pruner_value"  # a function objective's reported value, in the epoch record
WALL = "wall_time"  # a pseudo-metric every fold has: its training time in seconds (its cost)


def parse(config: dict) -> dict:
    """``search.objective``: ``metric`` (a name, or a list for several objectives), ``mode``
    (final | best), ``direction`` (minimize | maximize, or one per objective), or ``function``
    (``module:func``, returning a number or one number per ``direction``). Adds ``metrics``
    (None for a function), ``directions`` and ``signs`` (+1 minimise, -1 maximise)."""
    obj = dict(config["search"]["objective"] or {"metric": "val_loss"})
    unknown = set(obj) - {"metric", "mode", "function", "direction"}
    if unknown:
        raise UsageError(f"search.objective: unknown field(s) {', '.join(sorted(unknown))} "
                         "(it takes metric, mode, direction, function)")
    if "function" in obj and "metric" in obj:
        raise UsageError("search.objective: give 'metric' or 'function', not both")
    if "function" in obj:
        obj["callable"] = load_builder(obj["function"] if ":" in obj["function"] else obj["function"] + ":objective")
        obj["metrics"] = None
    else:
        obj.setdefault("metric", "val_loss")
        metrics = obj["metric"] if isinstance(obj["metric"], list) else [obj["metric"]]
        if not metrics or not all(isinstance(m, str) and m for m in metrics):
            raise UsageError(f"search.objective.metric is {obj['metric']!r}; give a metric name "
                             "or a list of them")
        obj["metrics"] = metrics
    obj.setdefault("mode", "final")
    if obj["mode"] not in ("final", "best"):
        raise UsageError(f"search.objective.mode is {obj['mode']!r}; choose final or best")
    directions = obj.get("direction", "minimize")
    directions = directions if isinstance(directions, list) else [directions]
    if obj["metrics"] is not None and len(directions) == 1:
        directions = directions * len(obj["metrics"])
    for d in directions:
        if d not in DIRECTIONS:
            raise UsageError(f"search.objective.direction has {d!r}; choose minimize or maximize")
    if obj["metrics"] is not None and len(directions) != len(obj["metrics"]):
        raise UsageError(f"search.objective: {len(obj['metrics'])} metric(s) but "
                         f"{len(directions)} direction(s)")
    obj["directions"] = directions
    obj["signs"] = [1.0 if d == "minimize" else -1.0 for d in directions]
    return obj


def losses(values, obj: dict):
    """Objective values as the searchers see them: minimised, a float or a tuple."""
    out = tuple(s * v for s, v in zip(obj["signs"], values))
    return out[0] if len(out) == 1 else out


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


def values_of(history: list, obj: dict, wall: float) -> list:
    """One value per objective from a fold's logged history (``best``: the best in each
    objective's own direction)."""
    out = []
    for metric, sign in zip(obj["metrics"], obj["signs"]):
        if metric == WALL:
            out.append(float(wall))
            continue
        values = [r[metric] for r in history if r.get(metric) is not None]
        if not values:
            raise RuntimeError(f"metric '{metric}' was never logged")
        out.append(float(values[-1] if obj["mode"] == "final" else sign * min(sign * v for v in values)))
    return out


def call_function(obj: dict, point: dict, report) -> list:
    """A function objective: ``f(params)`` or ``f(params, report)``, where ``report(step,
    value)`` returns True when the pruner stops the trial (the function then returns early)."""
    import inspect

    func = obj["callable"]
    takes_report = len(inspect.signature(func).parameters) >= 2
    value = func(dict(point), report) if takes_report else func(dict(point))
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(values) != len(obj["directions"]):
        raise ValueError(f"the objective function returned {len(values)} value(s) for "
                         f"{len(obj['directions'])} direction(s)")
    return [float(v) for v in values]


class _Prefixed:
    """A text stream that starts every line with ``prefix`` (a fold's output, told apart
    from the other blocks' in the job's one log)."""

    def __init__(self, stream, prefix: str):
        self.stream, self.prefix, self.fresh = stream, prefix, True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            if self.fresh:
                out.append(self.prefix)
            out.append(piece)
            self.fresh = piece.endswith("\n")
        self.stream.write("".join(out))
        return len(text)

    def __getattr__(self, name):  # flush, fileno, isatty, encoding: the real stream's
        return getattr(self.stream, name)


@contextlib.contextmanager
def prefixed_output(prefix: str):
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Prefixed(sys.stdout, prefix), _Prefixed(sys.stderr, prefix)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def run_fold(config: dict, point: dict, fold: int, ctx, output: str, obj: dict,
             n_events: Optional[int], on_epoch=None, key: str = "", prior_wall: float = 0.0,
             force: bool = False, watch=None) -> dict:
    """:func:`_run_fold` with every line it prints prefixed by ``[trial KEY fold K]``."""
    with prefixed_output(f"[trial {key} fold {fold}] "):
        return _run_fold(config, point, fold, ctx, output, obj, n_events, on_epoch,
                         prior_wall, force, watch)


def _run_fold(config: dict, point: dict, fold: int, ctx, output: str, obj: dict,
              n_events: Optional[int], on_epoch=None, prior_wall: float = 0.0,
              force: bool = False, watch=None) -> dict:
    """Collective over ``ctx.comm``: trains one fold; never raises for a failed trial, only
    for a lost rank (MPI's report, or ``watch``'s: called after every step, it raises when a
    rank of the block outside this fold was lost).

    A fold that a stop signal interrupted returns status ``interrupted``; run again, it
    continues from its own checkpoint, and its ``wall`` (and a ``wall_time`` objective)
    counts the earlier sessions' ``prior_wall`` seconds too. ``force``: the sweep was resumed
    with --force, so a fold continues under the changed config."""
    session = time.time()
    start = session - prior_wall  # wall = every session of this fold
    search = config["search"]
    try:
        if "callable" in obj:
            values = None
            if ctx.rank == 0:
                report = None if on_epoch is None else \
                    (lambda step, value: on_epoch({"epoch": step, PRUNE_KEY: value}))
                values = call_function(obj, point, report)
            values = ctx.comm.bcast(values, root=0)
        else:
            from ..train.engine import Trainer

            trial = dict(config)
            trial["hparams"] = apply(config["hparams"], point, default_hparams(config["model"]))
            events = fold_events(n_events, search["folds"], fold, search["seed"],
                                 config["data"]["val_fraction"] or 0.2)
            deadline = session + search["trial_timeout"] if search["trial_timeout"] > 0 else None
            # a fold directory exists only for a trial run again (interrupted): continue it
            trainer = Trainer(trial, ctx, output=output, progress=False, events=events,
                              deadline=deadline, resume="auto", force=force,
                              announce_fresh=False)
            trainer.announce_stop = False  # the sweep says it once, for every fold
            trainer.step_watch = watch
            if on_epoch is not None:
                from ..train.callbacks import Report

                trainer.callbacks.append(Report(on_epoch))
            trainer.fit()
            values = values_of(trainer.history, obj, time.time() - start)
            if trainer.log is not None:  # TensorBoard's HParams tab: this fold's point and value
                trainer.log.hparams(point, dict(zip(obj["metrics"], values)))
        bad = [v for v in values if not math.isfinite(v)]
        if bad:
            return {"status": "failed", "reason": f"objective is {bad[0]}", "wall": time.time() - start}
        return {"status": "done", "values": values, "wall": time.time() - start}
    except preempt.Preempted:
        return {"status": "interrupted", "wall": time.time() - start}
    except Exception as err:  # a failed trial is recorded, the sweep goes on
        from ..core.membership import lost

        # a rank lost, not the trial's fault: the block handles it (a Keras step's allreduce
        # reports it as TensorFlow's own error, over a communicator that knows of the loss)
        if lost(err, ctx.comm):
            raise
        reason = f"{type(err).__name__}: {err}"
        if not isinstance(err, (UsageError, TrainingStopped)):  # ours need no traceback
            reason += "\n" + "".join(traceback.format_exception(err)[-3:])
        # its output is gone (the launcher died): the job is dying, not the trial
        killed = isinstance(err, OSError) and err.errno in (errno.EIO, errno.EPIPE)
        return {"status": "failed", "reason": reason.strip(), "wall": time.time() - start,
                **({"killed": True} if killed else {})}
