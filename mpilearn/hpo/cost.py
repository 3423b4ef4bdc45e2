"""What a run or a sweep cost: device-hours by kind (GPU-hours on GPU ranks, CPU-rank-hours on
CPU ranks), and in money at a price per device kind, with its currency.

Two counts, side by side:

- **inside epochs**: a training run's epoch records (``device_hours``: ranks x the epoch's
  wall seconds, training and validation), and a sweep's trials (their folds' ranks x wall,
  every session of each fold: a fold's start-up, evaluation and checkpoints included);
- **launched**: every rank's wall time from its process's start to its end (start-up,
  evaluation, checkpoints, the test pass, the export; in a sweep also the coordinator and the
  blocks' waits), which is what an allocation is paid for: ``launches.jsonl`` of a training
  run (``train/launches.py``), the ``job`` and ``job_end`` events of a sweep's journal. Money
  is charged on it, each rank at its own kind's price: a CPU rank never at the GPU rate.

A sweep job killed before its ``job_end`` counts from its start to its last event, its
coordinator as a CPU rank and the others as its trials' kind.
"""
from __future__ import annotations

import glob
import os
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

from ..core.io import read_jsonl

KINDS = ("gpu", "cpu")
UNITS = {"gpu": "GPU-hours", "cpu": "CPU-rank-hours"}


def unit(device: str) -> str:
    return UNITS["gpu" if device == "gpu" else "cpu"]


@dataclass(frozen=True)
class Price:
    """One GPU-hour (a GPU rank's hour) and one CPU-rank-hour (a CPU rank's hour, its cores
    included), in ``currency``; 0: not priced."""
    gpu_hour: float = 0.0
    cpu_hour: float = 0.0
    currency: str = ""

    def per_hour(self, device: str) -> float:
        return self.gpu_hour if device == "gpu" else self.cpu_hour

    def money(self, hours: Dict[str, float]) -> Optional[float]:
        """The price of ``hours`` (kind -> hours); None when a kind used has no price."""
        used = [k for k, h in hours.items() if h > 0]
        if not used or any(not self.per_hour(k) for k in used):
            return None
        return sum(hours[k] * self.per_hour(k) for k in used)

    def rates(self, kinds) -> str:
        """'2.5 USD per GPU-hour, 0.05 USD per CPU-rank-hour' for the kinds used."""
        cur = f" {self.currency}" if self.currency else ""
        return ", ".join(f"{self.per_hour(k):g}{cur} per {UNITS[k][:-1]}" if self.per_hour(k)
                         else f"no price for {UNITS[k]}" for k in KINDS if k in kinds)


def price_from_site(value, source: str = "site") -> Optional[Price]:
    """The site profile's ``price`` (``{gpu_hour: 2.5, cpu_hour: 0.05, currency: USD}``, checked
    by ``cluster/price.parse``, which names ``source`` in its errors) as a Price; None when
    nothing is priced. A bare number (the older form) prices GPU-hours only."""
    from ..cluster import price

    if value is None or value == {}:
        return None
    found = Price(**price.parse(value, source))
    return found if found.gpu_hour or found.cpu_hour else None


# -- a training run ----------------------------------------------------------------------

def run_epochs(run_dir: str) -> List[dict]:
    """The epoch records of a run that carry a cost (older runs have none)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [r for r in read_jsonl(path) if "epoch" in r and "device_hours" in r]


def run_launches(run_dir: str) -> List[dict]:
    path = os.path.join(run_dir, "launches.jsonl")
    return read_jsonl(path) if os.path.exists(path) else []


def by_kind(pairs) -> Dict[str, float]:
    """(kind, hours) pairs summed per kind."""
    out: Dict[str, float] = {}
    for kind, hours in pairs:
        k = "gpu" if kind == "gpu" else "cpu"
        out[k] = out.get(k, 0.0) + hours
    return out


def run_summary(run_dir: str, price: Optional[Price]) -> dict:
    epochs = run_epochs(run_dir)
    launches = run_launches(run_dir)
    in_epochs = by_kind((r.get("device", "cpu"), r["device_hours"]) for r in epochs)
    launched = by_kind((d, s / 3600) for l in launches
                       for d, s in zip(l["devices"], l["launched_s"])) if launches else None
    out = {"epochs": len(epochs), "in_epochs": in_epochs,
           "per_launch": [{"launch": l["launch"], "ranks": l["ranks"], "exit": l["exit"],
                           "devices": sorted(set(l["devices"])),
                           "seconds": [min(l["launched_s"]), max(l["launched_s"])],
                           "ranks_at_end": l.get("ranks_at_end", l["ranks"]),
                           "lost": len(l.get("lost", [])), "spawned": len(l.get("spawned", []))}
                          for l in launches],
           "per_epoch": [r["device_hours"] for r in epochs],
           "launches": len(launches), "launched": launched,
           "launched_per_rank_s": [l["launched_s"] for l in launches],
           "share_in_epochs": (sum(in_epochs.values()) / sum(launched.values())
                               if launched and sum(launched.values()) else None)}
    if price:
        out.update(price=asdict(price), cost=price.money(launched or in_epochs))
    return out


def hours_text(hours: Dict[str, float]) -> str:
    parts = [f"{hours[k]:.4g} {UNITS[k]}" for k in KINDS if hours.get(k)]
    return " + ".join(parts) or f"0 {UNITS['cpu']}"


def _money(hours: Dict[str, float], price: Optional[Price]) -> str:
    if not price:
        return ""
    amount = price.money(hours)
    rates = price.rates(hours)
    cur = f" {price.currency}" if price.currency else ""
    return f" = {amount:.4g}{cur} ({rates})" if amount is not None else f" ({rates})"


def run_lines(summary: dict, price: Optional[Price] = None) -> List[str]:
    n, in_epochs, launched = summary["epochs"], summary["in_epochs"], summary["launched"]
    if not n and not launched:
        return ["cost: no epoch records with device_hours (a run from before they were kept)"]
    total = sum(in_epochs.values())
    lines = [f"cost: inside epochs {hours_text(in_epochs)} over {n} epoch(s), "
             f"{total / max(n, 1):.4g} per epoch"]
    if launched:
        share = summary["share_in_epochs"]
        lines.append(f"cost: launched {hours_text(launched)} over {summary['launches']} "
                     f"launch(es) (every rank from its start to its end: start-up, evaluation, "
                     f"checkpoints and export included)"
                     + (f"; the epochs are {share:.0%} of it" if share is not None else ""))
        for l in summary["per_launch"]:
            lo, hi = l["seconds"]
            status = "running or killed" if l["exit"] is None else f"exit {l['exit']}"
            changed = "".join(f", {l[k]} {k}" for k in ("lost", "spawned") if l.get(k))
            if changed:
                changed += f", ending on {l['ranks_at_end']}"
            lines.append(f"cost: launch {l['launch']}: {l['ranks']} {'+'.join(l['devices'])} "
                         f"rank(s){changed}, each {lo:.1f}"
                         + (f"-{hi:.1f}" if hi - lo >= 0.05 else "")
                         + " s from its start to its end"
                         + (" (a lost one: to its loss)" if l.get("lost") else "")
                         + f" ({status})")
    else:
        lines.append("cost: no launches.jsonl (a run from before it was kept): the launched "
                     "time is unknown; the total counts the epochs only")
    lines.append(f"cost: total {hours_text(launched or in_epochs)}"
                 f"{_money(launched or in_epochs, price)}")
    return lines


# -- a sweep -------------------------------------------------------------------------------

def trial_epochs(run_dir: str, key: str) -> int:
    """Epochs a trial trained: its folds' epoch records (fold dirs run side by side count
    as one epoch each)."""
    return sum(len([r for r in read_jsonl(p) if "epoch" in r])
               for p in glob.glob(os.path.join(run_dir, "trials", key, "fold*", "metrics.jsonl")))


def sweep_launched(events: list, trial_kind: str) -> Optional[Dict[str, float]]:
    """Every job's ranks x their wall time, by kind, from its 'job' (start-up seconds) and
    'job_end' (launched seconds, devices) events; a job killed before its end counts to its
    last event. None for a journal from before jobs recorded their ranks."""
    jobs, pairs = [], []
    for e in events:
        if e["event"] == "job":
            jobs.append({"start": e, "last": e["time"], "end": None})
        elif jobs:
            jobs[-1]["last"] = e["time"]
            if e["event"] == "job_end":
                jobs[-1]["end"] = e
    if not jobs or any("startup_s" not in j["start"] for j in jobs):
        return None
    for j in jobs:
        if j["end"] is not None:
            pairs += [(d, s / 3600) for d, s in zip(j["end"]["devices"], j["end"]["launched_s"])]
        else:
            span = j["last"] - j["start"]["time"]
            pairs += [("cpu" if r == 0 else trial_kind, (s + span) / 3600)
                      for r, s in enumerate(j["start"]["startup_s"])]
    return by_kind(pairs)


def sweep_summary(run_dir: str, rows: list, events: list, best: Optional[dict],
                  price: Optional[Price]) -> dict:
    """Per trial and in total; and what reaching the best trial's quality took: the
    device-hours of every trial finished by then, and the seconds since the sweep began."""
    ends = ("done", "failed", "pruned")
    costs = {e["key"]: e for e in events if e["event"] in ends and "device_hours" in e}
    for r in rows:
        c = costs.get(r["key"])
        r["device_hours"] = c["device_hours"] if c else None
        r["cost"] = price.money({c.get("device", "cpu"): c["device_hours"]}) \
            if c and price else None
    counted = [e for e in events if e["event"] in ends and "device_hours" in e]
    trials = by_kind((e.get("device", "cpu"), e["device_hours"]) for e in counted)
    total = sum(trials.values())
    kind = "gpu" if trials.get("gpu") else "cpu"
    epochs = sum(trial_epochs(run_dir, e["key"]) for e in counted)
    launched = sweep_launched(events, kind)
    out = {"device": kind, "trials_hours": trials, "device_hours": total,
           "trials_costed": len(counted), "epochs": epochs,
           "per_trial": total / len(counted) if counted else None,
           "per_epoch": total / epochs if epochs else None, "launched": launched,
           "share_in_trials": total / sum(launched.values())
           if launched and sum(launched.values()) else None, "to_best": None}
    if best is not None and best["key"] in costs:
        t0 = events[0]["time"] if events else 0.0
        upto = costs[best["key"]]["time"]
        hours = by_kind((e.get("device", "cpu"), e["device_hours"]) for e in counted
                        if e["time"] <= upto)
        out["to_best"] = {"trial": best["trial"], "device_hours": sum(hours.values()),
                          "hours": hours, "seconds": upto - t0}
    if price:
        out["price"] = asdict(price)
        out["cost"] = price.money(launched or trials)
        out["cost_trials"] = price.money(trials)
        for key in ("per_trial", "per_epoch"):
            out[f"cost_{key}"] = price.money({kind: out[key]}) if out[key] is not None else None
        if out["to_best"]:
            out["to_best"]["cost"] = price.money(out["to_best"]["hours"])
    return out


def sweep_lines(s: dict, price: Optional[Price] = None) -> List[str]:
    if not s["trials_costed"]:
        return ["cost: no finished trial records device_hours (a sweep from before they were "
                "kept)"]
    kind = s["device"]
    lines = []
    if s["per_epoch"] is not None:
        lines.append(f"cost: {s['per_epoch']:.4g} {unit(kind)} per epoch ({s['epochs']} "
                     f"epoch(s)){_money({kind: s['per_epoch']}, price)}")
    lines.append(f"cost: {s['per_trial']:.4g} {unit(kind)} per trial ({s['trials_costed']} "
                 f"trial(s), each fold from its start to its end)"
                 f"{_money({kind: s['per_trial']}, price)}")
    launched = s["launched"]
    if launched:
        lines.append(f"cost: trials {hours_text(s['trials_hours'])} of {hours_text(launched)} "
                     f"launched ({s['share_in_trials']:.0%}; the rest: the ranks' start-up, "
                     "the coordinator, blocks waiting for trials)")
    else:
        lines.append("cost: the journal records no job's ranks (a sweep from before they were "
                     "kept): the total counts the trials only")
    lines.append(f"cost: total {hours_text(launched or s['trials_hours'])}"
                 f"{_money(launched or s['trials_hours'], price)}")
    b = s["to_best"]
    if b:
        lines.append(f"cost: reaching the best trial's quality (trial {b['trial']}) took "
                     f"{hours_text(b['hours'])}{_money(b['hours'], price)} and "
                     f"{b['seconds']:.0f} s of the sweep")
    return lines
