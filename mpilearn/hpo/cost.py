"""What a run or a sweep cost, in device-hours (ranks x wall seconds / 3600: GPU-hours on
GPUs, CPU-rank-hours on CPUs) and, given a price per device-hour, in money.

A training run's ``metrics.jsonl`` has ``device_hours`` per epoch; a sweep's journal has
them per finished trial (its folds' ranks x wall, every session of each fold). The sweep's
coordinator (one CPU rank, mostly idle) is not counted.
"""
from __future__ import annotations

import glob
import os
from typing import List, Optional

from ..core.io import read_jsonl


def unit(device: str) -> str:
    return "GPU-hours" if device == "gpu" else "CPU-rank-hours"


def run_epochs(run_dir: str) -> List[dict]:
    """The epoch records of a run that carry a cost (older runs have none)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [r for r in read_jsonl(path) if "epoch" in r and "device_hours" in r]


def _money(hours: float, price: Optional[float]) -> str:
    return f" = {hours * price:.4g} at {price:g} per device-hour" if price else ""


def run_summary(run_dir: str, price: Optional[float]) -> dict:
    epochs = run_epochs(run_dir)
    hours = sum(r["device_hours"] for r in epochs)
    device = epochs[-1]["device"] if epochs else "cpu"
    out = {"device": device, "epochs": len(epochs), "device_hours": hours,
           "per_epoch": [r["device_hours"] for r in epochs]}
    if price:
        out.update(price=price, cost=hours * price,
                   cost_per_epoch=hours * price / len(epochs) if epochs else None)
    return out


def run_lines(summary: dict) -> List[str]:
    n, hours, price = summary["epochs"], summary["device_hours"], summary.get("price")
    if not n:
        return ["cost: no epoch records with device_hours (a run from before they were kept)"]
    u = unit(summary["device"])
    return [f"cost: {hours:.4g} {u} over {n} epoch(s), {hours / n:.4g} per epoch"
            f"{_money(hours / n, price)}",
            f"cost: total {hours:.4g} {u}{_money(hours, price)}"]


def trial_epochs(run_dir: str, key: str) -> int:
    """Epochs a trial trained: its folds' epoch records (fold dirs run side by side count
    as one epoch each)."""
    return sum(len([r for r in read_jsonl(p) if "epoch" in r])
               for p in glob.glob(os.path.join(run_dir, "trials", key, "fold*", "metrics.jsonl")))


def sweep_summary(run_dir: str, rows: list, events: list, best: Optional[dict],
                  price: Optional[float]) -> dict:
    """Per trial and in total; and what reaching the best trial's quality took: the
    device-hours of every trial finished by then, and the seconds since the sweep began."""
    costs = {e["key"]: e for e in events
             if e["event"] in ("done", "failed", "pruned") and "device_hours" in e}
    for r in rows:
        r["device_hours"] = costs[r["key"]]["device_hours"] if r["key"] in costs else None
    counted = [e for e in events if e["event"] in ("done", "failed", "pruned")
               and "device_hours" in e]
    total = sum(e["device_hours"] for e in counted)
    device = "gpu" if any(e.get("device") == "gpu" for e in counted) else "cpu"
    epochs = sum(trial_epochs(run_dir, e["key"]) for e in counted)
    out = {"device": device, "device_hours": total, "trials_costed": len(counted),
           "epochs": epochs, "per_trial": total / len(counted) if counted else None,
           "per_epoch": total / epochs if epochs else None, "to_best": None}
    if best is not None and best["key"] in costs:
        t0 = events[0]["time"] if events else 0.0
        upto = costs[best["key"]]["time"]
        hours = sum(e["device_hours"] for e in counted if e["time"] <= upto)
        out["to_best"] = {"trial": best["trial"], "device_hours": hours, "seconds": upto - t0}
    if price:
        out["price"] = price
        out["cost"] = total * price
        for key in ("per_trial", "per_epoch"):
            out[f"cost_{key}"] = out[key] * price if out[key] is not None else None
        if out["to_best"]:
            out["to_best"]["cost"] = out["to_best"]["device_hours"] * price
    return out


def sweep_lines(s: dict) -> List[str]:
    if not s["trials_costed"]:
        return ["cost: no finished trial records device_hours (a sweep from before they were "
                "kept)"]
    u, price = unit(s["device"]), s.get("price")
    lines = []
    if s["per_epoch"] is not None:
        lines.append(f"cost: {s['per_epoch']:.4g} {u} per epoch ({s['epochs']} epoch(s))"
                     f"{_money(s['per_epoch'], price)}")
    lines.append(f"cost: {s['per_trial']:.4g} {u} per trial ({s['trials_costed']} trial(s))"
                 f"{_money(s['per_trial'], price)}")
    lines.append(f"cost: total {s['device_hours']:.4g} {u}{_money(s['device_hours'], price)}")
    b = s["to_best"]
    if b:
        lines.append(f"cost: reaching the best trial's quality (trial {b['trial']}) took "
                     f"{b['device_hours']:.4g} {u}{_money(b['device_hours'], price)} and "
                     f"{b['seconds']:.0f} s of the sweep")
    return lines
