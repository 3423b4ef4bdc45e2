"""Large-batch learning-rate rules: the configured rate scaled to the global batch, with a warm-up.

``train.base_batch`` is the global batch the configured rates were tuned for (0 = the per-rank
batch, so that ``linear`` is lr x ranks, Horovod's rule). With k = global / base:

- ``linear``: lr x k (Goyal et al. 2017): SGD's rule;
- ``sqrt``: lr x √k (Krizhevsky 2014; Hoffer et al. 2017; for adaptive optimizers Malladi et
  al. 2022, arXiv 2205.10287, and Granziol et al. 2022): RMSprop and Adam divide by √v ≈ σ/√B
  where noise dominates, so their step already grows like √B;
- ``auto`` (the default): ``sqrt`` for an adaptive optimizer (RMSprop, Adam, AdamW, Adagrad and
  the Keras ones: whatever has an epsilon), ``linear`` for SGD, per optimizer;
- ``srsr``: Malladi's square-root scaling rule in full: lr x √k, each (1 - β) x k, eps / √k
  (SGD: linear); refused where k (1 - β) > 0.5 for a β of the optimizer;
- ``gain``: AdaScale's gain ratio r = (B_n/B_base + 1) / (B_n/B_global + 1) from the measured
  noise scale B_n of each optimizer (``allreduce/noise.py``; Johnson et al. 2020): lr x r for
  SGD, x √r for an adaptive optimizer, so the rate grows only as far as the larger batch
  helps (1 until the first epoch has measured it);
- ``none``: the configured rate.

Over the
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


SRSR_BOUND = 0.5  # k (1 - β) above it: β would be too small for the SDE approximation


def target_scale(rule: str, global_batch: int, base_batch: int, gain: float = 1.0) -> float:
    """The factor on the configured rate once the warm-up is over (``rule`` concrete: none,
    linear, sqrt, or gain-linear / gain-sqrt with the measured ``gain``)."""
    ratio = global_batch / base_batch
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio), "srsr": math.sqrt(ratio),
            "gain-linear": gain, "gain-sqrt": math.sqrt(gain)}[rule]


def concrete(rule: str, adaptive: bool) -> str:
    """What ``rule`` does for an optimizer that is ``adaptive`` or not."""
    if rule == "auto":
        return "sqrt" if adaptive else "linear"
    if rule == "srsr":
        return "srsr" if adaptive else "linear"
    if rule == "gain":
        return "gain-sqrt" if adaptive else "gain-linear"
    return rule


def gain_ratio(noise_scale, global_batch: int, base_batch: int) -> float:
    """AdaScale's gain r = (σ² + μ²) / (σ²/k + μ²) with σ²/μ² = B_noise / B_base at the base
    batch: between 1 (no noise: a larger batch adds nothing) and k (pure noise)."""
    if noise_scale is None or not noise_scale > 0 or global_batch <= base_batch:
        return 1.0
    return (noise_scale / base_batch + 1.0) / (noise_scale / global_batch + 1.0)


def srsr_moments(moments: dict, k: float) -> dict:
    """Malladi's rule on an optimizer's β's and ε (``moments``: name -> value, β's as
    'beta*'/'alpha'/'rho', ε as 'eps'/'epsilon'): each 1 - β times k, ε over √k. Raises
    ValueError naming β, k and the bound where k (1 - β) > 0.5."""
    out = {}
    for name, value in moments.items():
        if name in ("eps", "epsilon"):
            out[name] = value / math.sqrt(k)
        elif value is not None:
            if k * (1.0 - value) > SRSR_BOUND:
                raise ValueError(f"train.lr_scaling: srsr at k = {k:g} (global batch / base "
                                 f"batch) makes 1 - {name} = {k:g} x {1 - value:.3g} = "
                                 f"{k * (1 - value):.3g}, above the bound {SRSR_BOUND} "
                                 f"({name} = {value:g}); use sqrt, or a base batch nearer the "
                                 "global batch")
            out[name] = 1.0 - k * (1.0 - value)
    return out


def factor(rule: str, global_batch: int, base_batch: int, warmup_steps: float, step: float,
           gain: float = 1.0) -> float:
    """The factor in force for the optimizer step ``step`` (0-based, counted over the run; a
    fraction after a size change)."""
    target = target_scale(rule, global_batch, base_batch, gain)
    start = min(1.0, target)
    ramp = 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)
    return start + (target - start) * ramp


def from_config(train: dict, ranks: int, steps_per_epoch: int, step: float,
                local_batch: int = 0, rule: str = "", gain: float = 1.0) -> float:
    """``factor`` for the config's ``train`` section at ``ranks`` ranks of ``local_batch``
    events (0: ``train.batch_size``; ``train.elastic.batch: global`` changes it); ``rule``:
    the concrete rule of one optimizer (default: the configured one, for a plain optimizer)."""
    base = train["base_batch"] or train["batch_size"]
    return factor(rule or concrete(train["lr_scaling"], False),
                  (local_batch or train["batch_size"]) * ranks, base,
                  train["warmup_epochs"] * steps_per_epoch, step, gain)
