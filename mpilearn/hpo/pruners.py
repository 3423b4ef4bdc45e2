"""Pruners: stop unpromising trials early, behind one question.

    stop = pruner.report(trial, step, value)   # the trial's value (mean over its folds) at step
    pruner.complete(trial)                     # the trial finished all its steps

``trial`` is the trial's number (its place in the sweep). Each pruner follows a published rule
and, where Optuna has one, Optuna's documented semantics, so that the same reported values give
the same verdicts as ``optuna.pruners``:

- ``median`` (Optuna's ``MedianPruner``): after ``n_startup_trials`` *completed* trials and
  ``n_warmup_steps`` steps, at the first report of every ``interval_steps`` interval, stop the
  trial when its best value so far is worse than the median of the completed trials' values at
  this step (``n_min_trials`` of them at least).
- ``asha`` (asynchronous successive halving, Li et al. 2020; Optuna's
  ``SuccessiveHalvingPruner``): rung r sits at step ``min_resource * reduction_factor **
  (min_early_stopping_rate + r)``. A trial reaching a rung records its value there and goes on
  only if it is among the best 1/``reduction_factor`` of all trials that reached that rung so far
  (running, stopped or complete); otherwise it stops.
- ``hyperband`` (Li et al. 2018; Optuna's ``HyperbandPruner``): several ASHA brackets with
  growing ``min_early_stopping_rate``; a trial's bracket comes from its number, weighted by each
  bracket's budget, and it competes only inside its bracket.

The state is a pure function of the sequence of calls, so a resumed sweep rebuilds it by
replaying its journal's verdicts and completions in order.
"""
from __future__ import annotations

import binascii
import math
from typing import Dict, List, Optional

import numpy as np


class Pruner:
    def __init__(self, direction: str = "minimize"):
        if direction not in ("minimize", "maximize"):
            raise ValueError(f"direction must be minimize or maximize, got {direction!r}")
        self.maximize = direction == "maximize"
        self.values: Dict[int, Dict[int, float]] = {}   # trial -> step -> value
        self.completed: List[int] = []
        self._completed = set()  # the same, to look up: a list's scan grew with the sweep

    def report(self, trial: int, step: int, value: float) -> bool:
        self.values.setdefault(trial, {})[int(step)] = float(value)
        return self.decide(trial, int(step))

    def complete(self, trial: int) -> None:
        if trial not in self._completed:
            self._completed.add(trial)
            self.completed.append(trial)

    def decide(self, trial: int, step: int) -> bool:
        raise NotImplementedError

    def worse(self, a: float, b: float) -> bool:
        return a < b if self.maximize else a > b


class NoPruner(Pruner):
    def decide(self, trial, step):
        return False


class MedianPruner(Pruner):
    def __init__(self, direction="minimize", n_startup_trials=5, n_warmup_steps=0,
                 interval_steps=1, n_min_trials=1, percentile=50.0):
        super().__init__(direction)
        if n_startup_trials < 0 or n_warmup_steps < 0:
            raise ValueError("n_startup_trials and n_warmup_steps must be >= 0")
        if interval_steps < 1 or n_min_trials < 1:
            raise ValueError("interval_steps and n_min_trials must be >= 1")
        self.n_startup_trials, self.n_warmup_steps = n_startup_trials, n_warmup_steps
        self.interval_steps, self.n_min_trials = interval_steps, n_min_trials
        self.percentile = percentile

    def _first_in_interval(self, trial: int, step: int) -> bool:
        # prune only at the first report inside each interval (reports may skip steps)
        lower = (step - self.n_warmup_steps) // self.interval_steps * self.interval_steps \
            + self.n_warmup_steps
        previous = max((s for s in self.values[trial] if s != step), default=-1)
        return previous < lower

    def decide(self, trial, step):
        done = self.completed
        if not done or len(done) < self.n_startup_trials or step < self.n_warmup_steps:
            return False
        if not self._first_in_interval(trial, step):
            return False
        mine = np.asarray(list(self.values[trial].values()), dtype=float)
        if np.all(np.isnan(mine)):
            return True
        best = np.nanmax(mine) if self.maximize else np.nanmin(mine)
        others = [self.values[t][step] for t in done if step in self.values.get(t, {})]
        if len(others) < self.n_min_trials:
            return False
        q = 100 - self.percentile if self.maximize else self.percentile
        return self.worse(best, float(np.nanpercentile(np.asarray(others, dtype=float), q)))


class SuccessiveHalvingPruner(Pruner):
    """ASHA. ``min_resource='auto'``: the longest completed trial's last step // 100 (at least
    1), found once the first trial completes (nothing is stopped before that)."""

    def __init__(self, direction="minimize", min_resource="auto", reduction_factor=4,
                 min_early_stopping_rate=0, bootstrap_count=0):
        super().__init__(direction)
        if min_resource != "auto" and (not isinstance(min_resource, int) or min_resource < 1):
            raise ValueError(f"min_resource must be 'auto' or an int >= 1, got {min_resource!r}")
        if not isinstance(reduction_factor, int) or reduction_factor < 2:
            raise ValueError(f"reduction_factor must be an int >= 2, got {reduction_factor!r}")
        if min_early_stopping_rate < 0 or bootstrap_count < 0:
            raise ValueError("min_early_stopping_rate and bootstrap_count must be >= 0")
        self.min_resource = None if min_resource == "auto" else min_resource
        self.reduction_factor, self.rate = reduction_factor, min_early_stopping_rate
        self.bootstrap_count = bootstrap_count
        self.rungs: Dict[int, Dict[int, float]] = {}   # rung -> trial -> value recorded there

    def _estimate_min_resource(self) -> Optional[int]:
        steps = [max(self.values[t]) for t in self.completed if self.values.get(t)]
        return max(max(steps) // 100, 1) if steps else None

    def decide(self, trial, step):
        value = self.values[trial][step]
        rung = sum(1 for r in self.rungs.values() if trial in r)  # rungs already passed
        while True:
            if self.min_resource is None:
                self.min_resource = self._estimate_min_resource()
                if self.min_resource is None:
                    return False
            if step < self.min_resource * self.reduction_factor ** (self.rate + rung):
                return False
            if math.isnan(value):
                return True
            at_rung = self.rungs.setdefault(rung, {})
            competing = [v for t, v in at_rung.items() if t != trial]
            competing.append(value)
            at_rung[trial] = value
            if len(competing) <= self.bootstrap_count:
                return True
            if not self._promotable(value, competing):
                return True
            rung += 1

    def _promotable(self, value: float, competing: List[float]) -> bool:
        k = max(len(competing) // self.reduction_factor - 1, 0)
        ranked = sorted(competing, reverse=self.maximize)
        return value >= ranked[k] if self.maximize else value <= ranked[k]


class HyperbandPruner(Pruner):
    """Brackets of ASHA. ``max_resource='auto'``: the longest completed trial's last step + 1,
    found once the first trial completes. ``sweep_name`` seeds the bracket assignment (Optuna
    uses its study name the same way)."""

    def __init__(self, direction="minimize", min_resource=1, max_resource="auto",
                 reduction_factor=3, bootstrap_count=0, sweep_name="mpilearn"):
        super().__init__(direction)
        if not isinstance(min_resource, int) or min_resource < 1:
            raise ValueError(f"min_resource must be an int >= 1, got {min_resource!r}")
        if max_resource != "auto" and (not isinstance(max_resource, int)
                                       or max_resource < min_resource):
            raise ValueError(f"max_resource must be 'auto' or an int >= min_resource, got "
                             f"{max_resource!r}")
        if not isinstance(reduction_factor, int) or reduction_factor < 2:
            raise ValueError(f"reduction_factor must be an int >= 2, got {reduction_factor!r}")
        self.direction = direction
        self.min_resource, self.max_resource = min_resource, max_resource
        self.reduction_factor, self.bootstrap_count = reduction_factor, bootstrap_count
        self.sweep_name = sweep_name
        self.brackets: List[SuccessiveHalvingPruner] = []
        self.budgets: List[int] = []

    def _start(self) -> bool:
        if self.brackets:
            return True
        if self.max_resource == "auto":
            steps = [max(self.values[t]) for t in self.completed if self.values.get(t)]
            if not steps:
                return False
            self.max_resource = max(steps) + 1
        n = math.floor(math.log(self.max_resource / self.min_resource, self.reduction_factor)) + 1
        for b in range(n):
            s = n - 1 - b
            self.budgets.append(math.ceil(n * self.reduction_factor ** s / (s + 1)))
            self.brackets.append(SuccessiveHalvingPruner(
                self.direction, self.min_resource, self.reduction_factor, b,
                self.bootstrap_count))
        return True

    def bracket_of(self, trial: int) -> int:
        n = binascii.crc32(f"{self.sweep_name}_{trial}".encode()) % sum(self.budgets)
        for b, budget in enumerate(self.budgets):
            n -= budget
            if n < 0:
                return b
        raise AssertionError("unreachable")

    def decide(self, trial, step):
        if not self._start():
            return False
        b = self.bracket_of(trial)
        bracket = self.brackets[b]  # its rungs hold its own trials only
        bracket.values = self.values
        bracket.completed = [t for t in self.completed if self.bracket_of(t) == b]
        return bracket.decide(trial, step)


PRUNERS = {"none": NoPruner, "median": MedianPruner, "asha": SuccessiveHalvingPruner,
           "hyperband": HyperbandPruner}


def make_pruner(name: str, direction: str = "minimize", **options) -> Pruner:
    """A pruner from ``search.pruner`` and ``search.pruner_options``; bad values raise
    ``UsageError`` naming the option."""
    import inspect

    from ..errors import UsageError
    from ..train.checks import did_you_mean

    if name not in PRUNERS:
        raise UsageError(f"search.pruner is {name!r}; choose one of {', '.join(PRUNERS)}")
    known = [p for p in inspect.signature(PRUNERS[name].__init__).parameters
             if p not in ("self", "direction")]
    for option in options:
        if option not in known:
            raise UsageError(f"search.pruner_options.{option}: not an option of the {name} pruner"
                             f"{did_you_mean(option, known)} (it takes: {', '.join(known) or 'none'})")
    try:
        return PRUNERS[name](direction, **options)
    except (ValueError, TypeError) as err:
        raise UsageError(f"search.pruner_options for the {name} pruner: {err}") from None
