"""What happens at the end of an epoch, beside training: each concern is a callback.

A callback declares the metric names it adds to the epoch record (:meth:`Callback.metric_names`,
which the HPO checks read before a sweep starts), may add them (``on_epoch_end``) and may ask
training to stop (it returns True). Every callback is called on every rank, in order: those the
task declares (``Task.callbacks(config)``, e.g. the 3DGAN's physics validation) add their
numbers first, then the record is written, then the stopping rules read it. A callback with
state (early stopping) puts it in the checkpoint.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

from ..errors import UsageError
from ..core.io import append_jsonl
from .best import improved, inferred_mode


class Callback:
    name = ""
    headline: tuple = ()  # metric names the epoch log's line on stdout shows
    # record -> a short text for the epoch line (e.g. numbers beside their floors), or None
    summary = None

    @classmethod
    def for_trainer(cls, trainer) -> "Callback":
        """A task-declared callback, built from the driver (its task, validation data,
        communicator, run directory, config and loggers)."""
        raise NotImplementedError(f"{cls.__name__} is not built by the engine")

    @classmethod
    def metric_names(cls, task, config: dict) -> set:
        """The names this callback adds to every epoch record of ``task`` under ``config``."""
        return set()

    @classmethod
    def metric_modes(cls, task, config: dict) -> dict:
        """Name -> min | max for the metrics it adds whose direction is known."""
        return {}

    @classmethod
    def preferred_monitor(cls, task, config: dict) -> str:
        """The metric ``train.best.monitor: auto`` follows when this callback applies."""
        return ""

    def on_epoch_end(self, record: dict) -> bool:
        """Called on every rank; may add to ``record``; True asks training to stop."""
        return False

    def on_membership(self, comm, change) -> None:
        """Called on every rank of the new communicator ``comm`` after an elastic change
        (``core.membership.Change``: ranks lost or spawned), at the step the run goes on from."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class EpochLog(Callback):
    """Rank 0: the record to ``metrics.jsonl``, to TensorBoard/CSV (``train.log``), and one
    line to stdout."""

    name = "log"

    def __init__(self, metrics_path: str, log=None, rank: int = 0, headline=(), summaries=()):
        self.metrics_path, self.log, self.rank = metrics_path, log, rank
        self.headline, self.summaries = set(headline), tuple(summaries)

    def on_epoch_end(self, record):
        if self.rank != 0:
            return False
        append_jsonl(self.metrics_path, record)
        self.log.epoch(record)
        # one short line: the losses (not a loss's terms: the 3DGAN has eight), the validation
        # metrics, the speed and each callback's summary (the full record is in metrics.jsonl)
        shown = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                 for k, v in record.items()
                 if (k.startswith("train_") and k.endswith("loss")) or k in self.headline
                 or (k.startswith("val_") and not k.endswith("_events")) or k == "samples_per_s"]
        extra = [text for summary in self.summaries if (text := summary(record))]
        print(f"epoch {record['epoch']}: " + "; ".join(filter(None, [", ".join(shown), *extra])),
              flush=True)
        return False


class EarlyStopping(Callback):
    """Stops when ``monitor`` has not improved by ``min_delta`` (in its ``mode``'s direction)
    for ``patience`` epochs; an epoch that does not log it counts neither way."""

    name = "early_stopping"

    def __init__(self, monitor: str, patience: int, min_delta: float, rank: int = 0,
                 mode: str = "min"):
        self.monitor, self.patience, self.min_delta, self.rank = monitor, patience, min_delta, rank
        self.mode, self.best, self.bad_epochs = mode, None, 0

    def on_epoch_end(self, record):
        value = record.get(self.monitor)
        if value is None:
            return False
        if improved(value, self.best, self.mode, self.min_delta):
            self.best, self.bad_epochs = value, 0
        else:
            self.bad_epochs += 1
        if self.bad_epochs < self.patience:
            return False
        if self.rank == 0:
            print(f"mpilearn: early stopping: {self.monitor} ({self.mode}) has not improved for "
                  f"{self.bad_epochs} epoch(s)", flush=True)
        return True

    def state_dict(self):
        return {"best": self.best, "bad_epochs": self.bad_epochs, "mode": self.mode}

    def load_state_dict(self, state):
        best = state["best"]
        # checkpoints from before modes held +inf for 'nothing yet'
        self.best = None if best is None or math.isinf(best) else best
        self.bad_epochs = state["bad_epochs"]


class BestCheckpoint(Callback):
    """Tracks the best value of ``monitor`` (``train.best``); after an epoch that improved it
    the engine keeps that epoch's checkpoint (``best.keep``). The best value is checkpointed."""

    name = "best"

    def __init__(self, monitor: str, mode: str):
        self.monitor, self.mode = monitor, mode
        self.best, self.epoch, self.improved = None, None, False

    def on_epoch_end(self, record):
        value = record.get(self.monitor)
        self.improved = improved(value, self.best, self.mode)
        if self.improved:
            self.best, self.epoch = float(value), record["epoch"]
        return False

    def state_dict(self):
        return {"monitor": self.monitor, "mode": self.mode, "best": self.best,
                "epoch": self.epoch}

    def load_state_dict(self, state):
        # a resumed run with another monitor or mode starts its own tracking
        if (state.get("monitor"), state.get("mode")) == (self.monitor, self.mode):
            self.best, self.epoch = state["best"], state["epoch"]


class Report(Callback):
    """An HPO trial's per-epoch report: ``report(record)`` is collective and returns True when
    the pruner stops the trial."""

    name = "report"

    def __init__(self, report: Callable[[dict], bool]):
        self.report = report

    def on_epoch_end(self, record):
        return bool(self.report(record))


# the callbacks every run has (after the task's), for the names they log
DEFAULT_CALLBACKS = (EpochLog, EarlyStopping)


def task_callbacks(task, config: dict) -> tuple:
    """The callback classes ``task`` declares for ``config`` (none for a task without the hook)."""
    declare = getattr(task, "callbacks", None)
    return tuple(declare(config)) if declare is not None else ()


def base_metric_names(task) -> set:
    """What the engine itself puts in every epoch record."""
    return ({"epoch", "step", "lr", "samples_per_s"}
            | {f"train_{k}" for k in getattr(task, "loss_names", ())}
            | {f"val_{k}" for k in getattr(task, "val_names", ())})


def logged_metrics(task, config: dict, extra: Optional[tuple] = ()) -> set:
    """Names every epoch record of ``task`` will carry (checked before an HPO sweep starts):
    the engine's and those each callback declares."""
    names = base_metric_names(task)
    for callback in (*task_callbacks(task, config), *DEFAULT_CALLBACKS, *extra):
        names |= callback.metric_names(task, config)
    return names


def known_modes(task, config: dict) -> dict:
    """Metric name -> mode (``best.MODES``) for every metric this run logs whose direction
    is known: inferred from the name, or declared by the callback that logs it."""
    modes = {n: m for n in logged_metrics(task, config) if (m := inferred_mode(n))}
    for callback in (*task_callbacks(task, config), *DEFAULT_CALLBACKS):
        modes.update(callback.metric_modes(task, config))
    return modes
