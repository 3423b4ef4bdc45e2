"""How a run scales: each optimizer's learning-rate rule and its measured gradient noise scale.

The driver asks three things of it: the rates for the next step (:meth:`Scaling.set_lr`), the
epoch record's ``noise_scale`` field (:meth:`Scaling.epoch_fields`, which also moves the
``gain`` rule's ratio), and the lines a user reads (the rule chosen, at the first epoch; what
the noise scale says about the rank count, at the end). Rules: ``lr_rules.py``; the noise scale
itself: ``allreduce/noise.py``.
"""
from __future__ import annotations

from typing import Dict, Optional

from ..allreduce.noise import NoiseScale, is_adaptive, useful_ranks
from ..errors import UsageError
from . import lr_rules



def moments(opt) -> dict:
    """The β's and ε that Malladi's rule rescales, by name (torch param groups, Keras
    attributes); empty for SGD."""
    groups = getattr(opt, "param_groups", None)
    if groups is not None:
        g, out = groups[0], {}
        if "alpha" in g:
            out["alpha"] = g["alpha"]
        if "betas" in g:
            out["beta1"], out["beta2"] = g["betas"]
        if "eps" in g and out:
            out["eps"] = g["eps"]
        return out
    out = {k: float(getattr(opt, k)) for k in ("rho", "beta_1", "beta_2")
           if isinstance(getattr(opt, k, None), (int, float))}
    if out and getattr(opt, "epsilon", None) is not None:
        out["epsilon"] = float(opt.epsilon)
    return out


def set_moments(opt, values: dict) -> None:
    groups = getattr(opt, "param_groups", None)
    if groups is None:
        for k, v in values.items():
            setattr(opt, k, v)
        return
    for g in groups:
        if "alpha" in values:
            g["alpha"] = values["alpha"]
        if "beta1" in values:
            g["betas"] = (values["beta1"], values["beta2"])
        if "eps" in values:
            g["eps"] = values["eps"]


def noise_of(opt) -> Optional[NoiseScale]:
    """The optimizer's noise-scale record (a wrapped torch or Keras optimizer), or None."""
    reducer = getattr(opt, "_reducer", None)
    return getattr(reducer, "noise", None) if reducer is not None else getattr(opt, "_noise", None)


class Scaling:
    """The rule of each of ``task``'s optimizers under ``train`` (the config's section)."""

    def __init__(self, train: dict, task):
        self.train, self.task = train, task
        opts = task.optimizers()
        self.base_lrs = task.learning_rates()
        self.base_moments = {k: moments(o) for k, o in opts.items()}
        self.adaptive = {k: is_adaptive(o) for k, o in opts.items()}
        # asynchronous workers apply their own updates: no global batch to scale for
        rule = "none" if train.get("algorithm") in ("downpour", "easgd") else train["lr_scaling"]
        self.rules = {k: lr_rules.concrete(rule, a) for k, a in self.adaptive.items()}
        self.gains = {k: 1.0 for k in opts}
        self.estimates: Dict[str, Optional[dict]] = {}
        self.lr, self.lrs = None, {}
        self._moments_at = None  # the k the β's were last set for

    @property
    def base_batch(self) -> int:
        return self.train["base_batch"] or self.train["batch_size"]

    def check(self, ranks: int, local_batch: int) -> None:
        """Raises UsageError where ``srsr`` cannot hold at this global batch."""
        k = local_batch * ranks / self.base_batch
        for name, rule in self.rules.items():
            if rule == "srsr":
                try:
                    lr_rules.srsr_moments(self.base_moments[name], k)
                except ValueError as err:
                    raise UsageError(f"{err} (optimizer {name!r})") from None

    def set_lr(self, ranks: int, local_batch: int, steps_per_epoch: int, step: float) -> float:
        """Every optimizer's rates (and, under ``srsr``, its β's and ε) for the next step."""
        lrs = {}
        for name, bases in self.base_lrs.items():
            f = lr_rules.from_config(self.train, ranks, steps_per_epoch, step, local_batch,
                                     self.rules[name], self.gains[name])
            lrs[name] = [base * f for base in bases]
        self.task.set_learning_rates(lrs)
        k = local_batch * ranks / self.base_batch
        if k != self._moments_at:
            self._moments_at = k
            opts = self.task.optimizers()
            for name, rule in self.rules.items():
                if rule == "srsr":
                    set_moments(opts[name], lr_rules.srsr_moments(self.base_moments[name], k))
        self.lrs = {k_: v[0] for k_, v in lrs.items()}
        self.lr = next(iter(self.lrs.values()))
        return self.lr

    def lr_fields(self) -> dict:
        """``lr`` (the first optimizer's), and ``lr_<optimizer>`` each where they differ."""
        out = {"lr": self.lr}
        if self.lr is not None and len(set(self.lrs.values())) > 1:
            out.update({f"lr_{k}": v for k, v in self.lrs.items()})
        return out

    def base_lr(self, ranks: int, local_batch: int, steps_per_epoch: int, step: float):
        """The first optimizer's rate at another size (the line at a size change)."""
        if not self.base_lrs:
            return None
        name = next(iter(self.base_lrs))
        return self.base_lrs[name][0] * lr_rules.from_config(
            self.train, ranks, steps_per_epoch, step, local_batch, self.rules[name],
            self.gains[name])

    def describe(self, ranks: int, local_batch: int) -> list:
        """Rank 0's lines at the first epoch: the rule each optimizer follows, and why; a
        warning where ``linear`` meets an adaptive optimizer."""
        configured = self.train["lr_scaling"]
        g = local_batch * ranks
        k = g / self.base_batch
        opts = self.task.optimizers()
        parts, lines = [], []
        for name, rule in self.rules.items():
            kind = type(opts[name]).__name__
            why = "adaptive" if self.adaptive[name] else "not adaptive"
            scale = {"none": "x1", "linear": f"x{k:.3g}", "sqrt": f"x{k ** 0.5:.3g}",
                     "srsr": f"x{k ** 0.5:.3g}, 1-beta x{k:.3g}, eps /{k ** 0.5:.3g}",
                     "gain-linear": "x the gain ratio", "gain-sqrt": "x sqrt(gain ratio)"}[rule]
            parts.append(f"{name} ({kind}, {why}): {rule} {scale}")
            if configured == "linear" and self.adaptive[name] and k != 1:
                lines.append(f"mpilearn: warning: train.lr_scaling: linear with {kind} "
                             f"({name}), an adaptive optimizer: its step already grows like "
                             "sqrt(batch); linear scaling adds noise (auto or sqrt is its rule)")
        head = (f"mpilearn: lr rule {configured} at global batch {g} = {k:.3g} x base batch "
                f"{self.base_batch}: " + "; ".join(parts))
        return [head] + lines

    # -- the noise scale -----------------------------------------------------------------
    def epoch_fields(self, local_batch: int, global_batch: int) -> dict:
        """``noise_scale`` for the epoch record: each optimizer's estimate over its newest
        measured steps (at least this epoch's); the ``gain`` rule's ratios follow it."""
        out = {}
        for name, opt in self.task.optimizers().items():
            noise = noise_of(opt)
            if noise is None:
                continue
            noise.take_epoch()
            est = noise.estimate(local_batch, global_batch)
            self.estimates[name] = est
            if est is not None:
                out[name] = {k: (round(v, 6) if isinstance(v, float) else v)
                             for k, v in est.items()}
                if self.rules[name].startswith("gain"):
                    self.gains[name] = lr_rules.gain_ratio(est["critical_batch"], global_batch,
                                                           self.base_batch)
                    out[name]["gain"] = round(self.gains[name], 6)
        return {"noise_scale": out} if out else {}

    def state_dict(self) -> dict:
        return {"gains": dict(self.gains),
                "noise": {name: n.state_dict() for name, opt in self.task.optimizers().items()
                          if (n := noise_of(opt)) is not None}}

    def load_state_dict(self, state: dict) -> None:
        self.gains.update(state.get("gains", {}))
        for name, opt in self.task.optimizers().items():
            noise = noise_of(opt)
            if noise is not None and name in state.get("noise", {}):
                noise.load_state_dict(state["noise"][name])

    def end_line(self, per_rank: int, ranks: int) -> Optional[str]:
        """What the last estimates say about the rank count, one line (None: none measured)."""
        parts = [advice(name, est, per_rank, ranks) for name, est in self.estimates.items()
                 if est is not None]
        if not parts:
            return None
        return "mpilearn: gradient noise scale: " + "; ".join(parts)


def advice(name: str, est: dict, per_rank: int, ranks: int) -> str:
    """One network's part of the end-of-run line: its critical batch and what it means for
    the rank count at ``per_rank`` events each."""
    crit, err = est["critical_batch"], est["critical_batch_err"]
    kind = "preconditioned" if est["preconditioned"] else "raw"
    if crit is None:
        return (f"{name}: the gradient is below its noise (|G|² ≤ 0 over {est['steps']} "
                "steps): the critical batch is beyond measure")
    pm = f" ± {err:.2g}" if err is not None else ""
    eff = est.get("efficiency")
    eff = f", data efficiency {eff:.0%} at global batch {est['global_batch']}" \
        if eff is not None else ""
    useful = useful_ranks(crit, per_rank, err)
    if useful is None:
        verdict = "too uncertain to count ranks by (its error is as large as it): train longer"
    else:
        verdict = (f"ranks beyond {useful} cost events, not time" if ranks > useful else
                   "a second rank would cost events, not time" if useful == 1 else
                   f"up to about {useful} ranks save time")
    return (f"{name}: critical batch ≈ {crit:.3g}{pm} events ({kind}{eff}): at {per_rank} "
            f"per rank, {verdict}")
