"""The gradient noise scale of one optimizer, measured from what data-parallel training holds.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", arXiv 1812.06162, §A.1):
with the per-event gradient covariance Σ and the true gradient G, a batch of B events has
E|g_B|² = |G|² + tr(Σ)/B. Two batch sizes give unbiased estimates of both terms:

    |G|²  ≈ (B_big |g_big|² − B_small |g_small|²) / (B_big − B_small)
    tr(Σ) ≈ (|g_small|² − |g_big|²) / (1/B_small − 1/B_big)

and the simple noise scale is B_simple = tr(Σ)/|G|², the critical batch: a global batch B costs
1 + B/B_simple times the minimal events and saves steps only while B stays below it.

Synchronous data parallelism computes both batches anyway: each rank's local gradient before
the allreduce (B_small = the per-rank batch) and the averaged one after it (B_big = N x that).
The reducer hands each bucket to :meth:`NoiseScale.local` before its allreduce and the reduced
buckets to :meth:`NoiseScale.reduced`; the ranks' local squared norms travel in one 2-element
allreduce beside the buckets. Nothing is read on the host per step: the values stay on the
device and are read at :meth:`NoiseScale.take` (once an epoch). At one rank the two halves of
the batch stand in for two ranks (:meth:`NoiseScale.halves`, every ``halves_every`` steps: it
costs one more backward pass of half the batch there).

The *preconditioned* variant weights every squared norm by the optimizer's own preconditioner
1/(√v + ε) (RMSprop's ``square_avg``, Adam's bias-corrected ``exp_avg_sq``, Adagrad's ``sum``):
the metric in which an adaptive optimizer steps, so its noise scale is the one that governs it.
Every estimate is invariant to a common scale of the gradients, so a loss divided by the global
batch (op=Sum) and an average (op=Average) give the same numbers.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import numpy as np
import torch

# second-moment state of the adaptive optimizers, by state key
_SECOND_MOMENTS = ("square_avg", "exp_avg_sq", "sum")
MIN_WINDOW = 50  # measured steps an estimate spans at least (an epoch's, where it has more)


def _row(size, summed, summed_p, big, big_p, fraction, device=None) -> torch.Tensor:
    """One measured step: contributions (ranks, or 2 halves), their summed squared norms (raw,
    preconditioned), the reduced gradient's two, and the events of one contribution per local
    batch; float64 on ``device`` (scalars or 0-d tensors: no host read). A host number becomes a
    fill on the device, not a copy: a copy from pageable host memory waits for the GPU's queue."""
    return torch.stack([v.to(torch.float64) if torch.is_tensor(v) else
                        torch.full((), float(v), dtype=torch.float64, device=device)
                        for v in (size, summed, summed_p, big, big_p, fraction)])


def is_adaptive(optimizer) -> bool:
    """Whether ``optimizer`` divides by a running second moment (RMSprop, Adam, AdamW,
    Adagrad, ...; Keras ones too): its param groups or config carry an epsilon."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is not None:
        return any("eps" in g for g in groups) and type(optimizer).__name__ != "SGD"
    return getattr(optimizer, "epsilon", None) is not None


def preconditioner(optimizer, param, group: Optional[dict] = None) -> Optional[torch.Tensor]:
    """1/(√v̂ + ε) for ``param`` (of param group ``group``, found when not given) from
    ``optimizer``'s state, or None (no state yet, or an optimizer without a second moment)."""
    state = optimizer.state.get(param) if hasattr(optimizer, "state") else None
    if not state:
        return None
    key = next((k for k in _SECOND_MOMENTS if k in state), None)
    if key is None:
        return None
    if group is None:
        group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    v = state[key]
    if key == "exp_avg_sq":  # Adam's bias correction
        v = v / _bias_correction(state, group)
    return 1.0 / (v.sqrt() + group.get("eps", 1e-8))


def _bias_correction(state: dict, group: dict) -> float:
    """Adam's 1 - beta2^step for a parameter's state (1 before its first step)."""
    step = state.get("step", 0)
    step = float(step.item() if torch.is_tensor(step) else step)
    return 1.0 - group["betas"][1] ** step if step > 0 else 1.0


class NoiseScale:
    """Per-step squared norms of one optimizer's gradients, kept on the device, and the
    noise-scale estimate over a window of steps (:meth:`estimate`)."""

    def __init__(self, optimizer=None, halves_every: int = 16):
        self.optimizer = optimizer
        self.halves_every = halves_every
        self.records: List[torch.Tensor] = []   # measured steps not yet taken to the host
        self.window: List[np.ndarray] = []      # host rows, the newest last
        self._local: List[torch.Tensor] = []
        self._pre: dict = {}                    # bucket id -> its preconditioner (this step)
        self._half = None
        self.steps = 0                          # optimizer steps seen (the halves' cadence)
        self._groups = {id(p): g for g in getattr(optimizer, "param_groups", ()) for p in g["params"]}

    # -- the reducer's hooks (every step) ---------------------------------------------
    def drop(self) -> None:
        """Forget a step in progress (the reducer's reset: a snapshot restored, a new size)."""
        self._local, self._pre, self._half = [], {}, None

    def _weights(self, bucket) -> Optional[torch.Tensor]:
        """The preconditioner laid out like ``bucket``'s buffer, or None. Built with a few
        multi-tensor kernels for the whole bucket, not a few per parameter: on a GPU each
        launch costs more than its arithmetic."""
        if self.optimizer is None:
            return None
        moments, scales, eps = [], [], []
        for p in bucket.params:
            state = self.optimizer.state.get(p)
            key = next((k for k in _SECOND_MOMENTS if k in state), None) if state else None
            if key is None:
                return None
            group = self._groups.get(id(p)) or next(
                g for g in self.optimizer.param_groups if any(q is p for q in g["params"]))
            moments.append(state[key])
            scales.append(_bias_correction(state, group) if key == "exp_avg_sq" else 1.0)
            eps.append(group.get("eps", 1e-8))
        if not moments:
            return None
        roots = torch._foreach_sqrt(moments)
        if any(c != 1.0 for c in scales):
            torch._foreach_div_(roots, [math.sqrt(c) for c in scales])
        torch._foreach_add_(roots, eps)
        torch._foreach_reciprocal_(roots)
        return torch.cat([r.reshape(-1) for r in roots]).to(bucket.buffer.dtype)

    def local(self, bucket) -> None:
        """Before ``bucket``'s allreduce: its local squared norms (raw, preconditioned)."""
        with torch.no_grad():
            buf = bucket.buffer
            w = self._weights(bucket)
            self._pre[id(bucket)] = w
            self._local.append(torch.stack([torch.dot(buf, buf), torch.dot(buf, buf * w)
                                            if w is not None else
                                            torch.full((), float("nan"), dtype=buf.dtype,
                                                       device=buf.device)]))

    def local_sums(self) -> Optional[torch.Tensor]:
        """This rank's two sums over its buckets, to be summed over the ranks (or None)."""
        if not self._local:
            return None
        total = torch.stack(self._local).sum(0).to(torch.float64)
        self._local = []
        return total

    def reduced(self, buckets: Sequence, size: int, summed: Optional[torch.Tensor]) -> None:
        """After the allreduce: the reduced buckets' squared norms beside the ranks' summed
        local ones (``summed``), recorded as one measured step."""
        self.steps += 1
        if summed is None or size < 2:
            self._pre = {}
            return
        with torch.no_grad():
            dev = summed.device
            big = sum(torch.dot(b.buffer, b.buffer).double() for b in buckets)
            pres = [self._pre.get(id(b)) for b in buckets]
            big_p = (sum(torch.dot(b.buffer, b.buffer * w).double() for b, w in zip(buckets, pres))
                     if all(w is not None for w in pres) else float("nan"))
            self.records.append(_row(float(size), summed[0], summed[1], big, big_p, 1.0, dev))
        self._pre = {}

    def record(self, size: int, summed: float, big: float) -> None:
        """One measured step given on the host (the Keras path): ``size`` ranks' summed
        squared norms of their contributions g_i/N, and the reduced gradient's; raw only."""
        nan = float("nan")
        self.records.append(_row(float(size), float(summed), nan, float(big), nan, 1.0))
        self.steps += 1

    # -- one rank: two halves of the batch ----------------------------------------------
    def halves_due(self) -> bool:
        """Whether this step (at one rank) measures from two halves of its batch."""
        return self.halves_every > 0 and self.steps % self.halves_every == 0

    def halves(self, first: Sequence[Optional[torch.Tensor]], params: Sequence[torch.Tensor]) -> None:
        """The first half's gradients of ``params``, each scaled as the whole batch's loss
        scales it (so whole = first + second); read at the next :meth:`reduced_one`."""
        self._half = (list(first), list(params))

    def reduced_one(self) -> None:
        """At one rank, after ``step``'s gradients are final: record the halves measured on
        this step as a two-rank step (each half a "rank" of half the batch), if any."""
        if self._half is None:
            self.steps += 1
            return
        first, params = self._half
        self._half = None
        with torch.no_grad():
            rows = torch.zeros(4, dtype=torch.float64)
            for g1, p in zip(first, params):
                if p.grad is None:
                    continue
                whole = p.grad.double()
                a = g1.double() if g1 is not None else torch.zeros_like(whole)
                b = whole - a
                w = (preconditioner(self.optimizer, p, self._groups.get(id(p)))
                     if self.optimizer is not None else None)
                w = w.double() if w is not None else torch.full_like(whole, float("nan"))
                rows += torch.stack([(a.square() + b.square()).sum(),
                                     ((a.square() + b.square()) * w).sum(),
                                     whole.square().sum(), (whole.square() * w).sum()]).cpu()
        self.records.append(_row(2.0, *rows, 0.5))
        self.steps += 1

    # -- reading --------------------------------------------------------------------------
    def take(self, window: int) -> int:
        """One host read of the measured steps since the last; keeps the newest ``window``
        of them. Returns how many were new."""
        new = 0
        if self.records:
            rows = torch.stack([r.to("cpu") for r in self.records]).numpy()
            self.records = []
            self.window.extend(rows)
            new = len(rows)
        if window > 0 and len(self.window) > window:
            self.window = self.window[-window:]
        return new

    def take_epoch(self, min_window: Optional[int] = None) -> None:
        """The window at an epoch's end: the epoch's measured steps, at least ``min_window``
        (default :data:`MIN_WINDOW`) of the newest (a short epoch borrows from the one before)."""
        self.take(max(MIN_WINDOW if min_window is None else min_window, self.take(0)))

    def state_dict(self) -> dict:
        self.take(0)
        return {"window": [row.tolist() for row in self.window], "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.records, self._local, self._pre, self._half = [], [], {}, None
        self.window = [np.asarray(row, dtype=np.float64) for row in state.get("window", [])]
        self.steps = int(state.get("steps", 0))

    def estimate(self, local_batch: float, global_batch: Optional[int] = None) -> Optional[dict]:
        """The window's estimate for ``local_batch`` events per rank per step: the simple
        noise scale in events, raw (``b_simple``) and preconditioned (``b_pre``), each with its
        standard error (a jackknife over blocks of consecutive steps); the critical batch (the
        preconditioned one for an adaptive optimizer) and the data efficiency at
        ``global_batch``. None before two measured steps."""
        if len(self.window) < 2:
            return None
        rows = np.asarray(self.window, dtype=np.float64)
        out = {}
        for name, col in (("b_simple", 1), ("b_pre", 2)):
            value, err = _ratio_with_error(rows[:, 0], rows[:, col], rows[:, col + 2],
                                           local_batch * rows[:, 5])
            out[name], out[name + "_err"] = value, err
        adaptive = self.optimizer is not None and is_adaptive(self.optimizer)
        key = "b_pre" if adaptive and out["b_pre"] is not None else "b_simple"
        out["critical_batch"], out["critical_batch_err"] = out[key], out[key + "_err"]
        out["preconditioned"] = key == "b_pre"
        if global_batch is not None:
            out["global_batch"] = int(global_batch)
            out["efficiency"] = efficiency(global_batch, out["critical_batch"])
        out["steps"] = len(rows)
        return out


def measure_halves(optimizer, half_loss) -> None:
    """At one rank, on the steps the optimizer's record asks for it: the gradients of
    ``half_loss()`` (the first half's share of the batch's loss, so that the whole batch's
    gradient is that half's plus the other's) taken beside the step's own backward."""
    reducer = getattr(optimizer, "_reducer", None)
    noise = getattr(reducer, "noise", None)
    if noise is None or reducer.size > 1 or not noise.halves_due():
        return
    params = [p for p in reducer.params if p.requires_grad]
    loss = half_loss()
    if not loss.requires_grad:
        return
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    noise.halves(grads, params)


def per_step(size: np.ndarray, summed: np.ndarray, big: np.ndarray, local_batch):
    """Each measured step's unbiased |G|² and tr(Σ) (per event) from ``size`` ranks' summed
    local squared norms (of contributions g_i/N), the reduced squared norm, and the events
    ``local_batch`` behind each contribution."""
    n = size
    small = n * summed               # the mean over ranks of |g_i|² (g_i = N x contribution)
    g2 = (n * big - small) / (n - 1)
    trace = local_batch * (small - big) * n / (n - 1)
    return g2, trace


def _ratio_with_error(size, summed, big, local_batch, blocks: int = 10):
    """mean tr(Σ) / mean |G|² over the steps (McCandlish: the two are averaged apart), and a
    delete-one-block jackknife standard error (blocks of consecutive steps keep the error
    honest where neighbouring steps are correlated)."""
    ok = np.isfinite(summed) & np.isfinite(big) & (size >= 2)
    if ok.sum() < 2:
        return None, None
    g2, trace = per_step(size[ok], summed[ok], big[ok], np.broadcast_to(local_batch, ok.shape)[ok])
    value = _ratio(trace.mean(), g2.mean())
    k = min(blocks, len(g2))
    parts = np.array_split(np.arange(len(g2)), k)
    jack = []
    for part in parts:
        keep = np.ones(len(g2), dtype=bool)
        keep[part] = False
        jack.append(_ratio(trace[keep].mean(), g2[keep].mean()))
    jack = np.asarray([j for j in jack if j is not None and math.isfinite(j)])
    if value is None or len(jack) < 2:
        return value, None
    err = float(np.sqrt((len(jack) - 1) / len(jack) * ((jack - jack.mean()) ** 2).sum()))
    return value, err


def _ratio(trace: float, g2: float) -> Optional[float]:
    """B_simple, or None where |G|² is not above 0 (the noise swamps the signal: the
    estimate says only that the critical batch is very large)."""
    if not (g2 > 0) or not math.isfinite(trace):
        return None
    return float(trace / g2)


def efficiency(global_batch: float, critical: Optional[float]) -> Optional[float]:
    """The data efficiency at ``global_batch``: E_min / E = 1 / (1 + B / B_noise)."""
    if critical is None or critical <= 0:
        return None
    return 1.0 / (1.0 + global_batch / critical)


def useful_ranks(critical: Optional[float], per_rank: int,
                 err: Optional[float] = None) -> Optional[int]:
    """Ranks of ``per_rank`` events up to the critical batch (at least 1); None where there is
    no estimate, or its error ``err`` is as large as it (a count read off an estimate that
    could as well be zero would mislead)."""
    if critical is None or (err is not None and err >= critical):
        return None
    return max(1, int(round(critical / per_rank)))
