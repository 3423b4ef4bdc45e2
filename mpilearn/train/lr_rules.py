"""Large-batch learning-rate rules: the configured rate scaled to the global batch, with a warm-up.

``train.base_batch`` is the global batch the configured rates were tuned for (0 = the per-rank
batch, so that ``linear`` is lr x ranks, Horovod's rule). The scale is global / base (``linear``,
Goyal et al. 2017) or its square root (``sqrt``, Krizhevsky 2014; Hoffer et al. 2017). Over the
first ``warmup_epochs`` the rate ramps linearly, step by step, from the configured rate (or the
scaled one where that is lower) to the scaled one. The factor is a pure function of the global
step, so a resumed run continues the schedule exactly.

At a size change (an elastic run, or a resume at another rank count) the rule is applied again
for the new global batch, and a warm-up in progress goes on from the same fraction of its epochs
(the engine passes the position in steps of the current size, ``epoch x steps + events / global
batch``): it reaches the new target at the same point of the data it would have reached the old.
"""
from __future__ import annotations

import math


def target_scale(rule: str, global_batch: int, base_batch: int) -> float:
    """The factor on the configured rate once the warm-up is over."""
    ratio = global_batch / base_batch
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def factor(rule: str, global_batch: int, base_batch: int, warmup_steps: float, step: float) -> float:
    """The factor in force for the optimizer step ``step`` (0-based, counted over the run; a
    fraction after a size change)."""
    target = target_scale(rule, global_batch, base_batch)
    start = min(1.0, target)
    ramp = 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)
    return start + (target - start) * ramp


def from_config(train: dict, ranks: int, steps_per_epoch: int, step: float,
                local_batch: int = 0) -> float:
    """``factor`` for the config's ``train`` section at ``ranks`` ranks of ``local_batch``
    events (0: ``train.batch_size``; ``train.elastic.batch: global`` changes it)."""
    base = train["base_batch"] or train["batch_size"]
    return factor(train["lr_scaling"], (local_batch or train["batch_size"]) * ranks, base,
                  train["warmup_epochs"] * steps_per_epoch, step)
