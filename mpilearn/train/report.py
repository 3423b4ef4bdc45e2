"""``python -m mpilearn.report RUN`` for a training run: what it learned and what it cost, from
its ``metrics.jsonl`` and ``launches.jsonl``, into ``RUN/report/``:

- ``summary.txt`` (also printed) and ``summary.json``: epochs, the last and best losses, the
  physics numbers of the last scored epoch against their floors, throughput, cost;
- ``losses.png``: every training and validation loss per epoch (and the other validation
  metrics in a panel of their own);
- ``physics.png``: each metric that has a ``<name>_floor`` beside it (the 3DGAN's ``score``,
  the CaloChallenge's ``fpd``, ``kpd``, ...) per epoch against its floor (the ratio in its
  title); not drawn, and said so, when the run logged none;
- ``throughput.png``: samples per second, and each epoch's time split (compute, allreduce,
  data wait) summed over the ranks;
- ``cost.png``: device-hours per epoch, and inside epochs against launched (``hpo/cost.py``);
- ``noise_scale.png``: each optimizer's critical batch (its gradient noise scale, raw and
  preconditioned, with its error) per epoch against the run's global batch
  (``allreduce/noise.py``); not drawn, and said so, when the run measured none;

and ``RUN/index.html``, all of it on one page with the config, the physics plots of every
validated epoch, membership changes, restarts and the noise scale (``train/page.py``).
"""
from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional

from ..core.io import atomic_write_text, read_jsonl

FLOOR = "_floor"


def epoch_records(run_dir: str) -> List[dict]:
    """Each epoch's record, the last one written where a resumed run wrote an epoch twice."""
    by_epoch = {}
    for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")):
        if "epoch" in r and "time" in r:
            by_epoch[r["epoch"]] = r
    return [by_epoch[e] for e in sorted(by_epoch)]


def membership_changes(run_dir: str) -> List[dict]:
    """The membership changes metrics.jsonl recorded (a lost rank, a growth), in order."""
    path = os.path.join(run_dir, "metrics.jsonl")
    return [r for r in read_jsonl(path) if isinstance(r.get("membership"), dict)] \
        if os.path.exists(path) else []


def describe_change(r: dict) -> str:
    """One membership record in words: where, what, the sizes, how long it took."""
    m = r["membership"]
    if m.get("spawned"):
        what = "spawned " + ", ".join(f"rank {k} on {h}" for k, h in
                                      zip(m.get("added_ranks", []), m.get("added_hosts", [])))
        took = f" in {m['spawn_s']:.3g} s" if _number(m.get("spawn_s")) else ""
    else:
        what = "lost " + ", ".join(f"rank {k} on {h}" for k, h in
                                   zip(m.get("lost_ranks", []), m.get("lost_hosts", [])))
        what += " (rank 0's duties moved)" if m.get("leader_lost") else ""
        took = f", recovered in {m['recovery_s']:.3g} s" if _number(m.get("recovery_s")) else ""
    return (f"epoch {r.get('epoch')}, step {r.get('step')}: {what}; {m.get('old_size')} -> "
            f"{m.get('ranks')} ranks{took}")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def series(records: List[dict], key: str):
    """(epochs, values) of ``key`` where an epoch logged it as a finite number."""
    pts = [(r["epoch"], r[key]) for r in records if _number(r.get(key))]
    return [p[0] for p in pts], [p[1] for p in pts]


def loss_keys(records: List[dict]) -> List[str]:
    keys = {k for r in records for k, v in r.items() if _number(v) and "loss" in k
            and k.startswith(("train_", "val_"))}
    return sorted(keys)


def other_val_keys(records: List[dict]) -> List[str]:
    keys = {k for r in records for k, v in r.items() if _number(v) and k.startswith("val_")
            and "loss" not in k and k != "val_events"}
    return sorted(keys)


def floored_metrics(records: List[dict]) -> List[str]:
    """The metrics that have a floor logged beside them: ``X`` with ``X_floor`` (any task,
    any callback: the plot needs no list of names)."""
    keys = {k[:-len(FLOOR)] for r in records for k, v in r.items()
            if k.endswith(FLOOR) and _number(v)}
    return sorted(k for k in keys if any(_number(r.get(k)) for r in records))


def summarise(run_dir: str, records: List[dict], costs: dict) -> dict:
    last = records[-1] if records else {}
    changes = membership_changes(run_dir)
    history = [n for n in [changes[0]["membership"].get("old_size")]
               + [c["membership"].get("ranks") for c in changes] if n is not None] \
        if changes else []
    out = {"run": run_dir, "epochs": len(records), "ranks": last.get("ranks"),
           "rank_history": history, "membership": [describe_change(c) for c in changes],
           "device": last.get("device"), "last": {}, "best": {}, "physics": {},
           "samples_per_s": None, "cost": costs}
    for key in loss_keys(records) + other_val_keys(records):
        epochs, values = series(records, key)
        if values:
            out["last"][key] = values[-1]
            i = min(range(len(values)), key=values.__getitem__)  # losses and errors: lower
            out["best"][key] = {"value": values[i], "epoch": epochs[i]}
    for name in floored_metrics(records):
        scored = [r for r in records if _number(r.get(name))]
        r = scored[-1]
        out["physics"][name] = {"epoch": r["epoch"], "value": r[name],
                                "floor": r.get(name + FLOOR), "ratio": r.get(name + "_ratio"),
                                # a floor that is 0 within its error: the distance in σ
                                "sigma": r.get(name + "_sigma"),
                                "floor_error": r.get(name + FLOOR + "_error")}
    rates = [r["samples_per_s"] for r in records if _number(r.get("samples_per_s"))]
    if rates:
        out["samples_per_s"] = {"mean": sum(rates) / len(rates), "last": rates[-1]}
    return out


def text_lines(s: dict, cost_lines: List[str], skipped: Dict[str, str]) -> List[str]:
    from ..calo.published import place, reference_lines
    from .page import ranks_text

    lines = [f"run {s['run']}: {s['epochs']} epoch(s) on {ranks_text(s)} {s['device']} rank(s)"]
    lines += [f"membership: {change}" for change in s.get("membership", [])]
    for key, value in s["last"].items():
        best = s["best"][key]
        lines.append(f"{key}: last {value:.5g}, lowest {best['value']:.5g} at epoch "
                     f"{best['epoch']}")
    for name, p in s["physics"].items():
        floor = f" against its floor {p['floor']:.4g}" if _number(p["floor"]) else ""
        ratio = f" (ratio {p['ratio']:.3g})" if _number(p["ratio"]) else ""
        if _number(p.get("sigma")):
            err = f" ± {p['floor_error']:.2g}" if _number(p.get("floor_error")) else ""
            floor = f" against its floor {p['floor']:.4f}{err}" if _number(p["floor"]) else ""
            ratio = f" ({p['sigma']:.3g} σ)"
        placed = place(name, p["value"])
        lines.append(f"physics {name}: {p['value']:.4g} at epoch {p['epoch']}{floor}{ratio}"
                     + (f", {placed}" if placed else ""))
    lines += reference_lines(list(s["physics"]))
    if s["samples_per_s"]:
        t = s["samples_per_s"]
        lines.append(f"throughput: {t['mean']:.4g} samples/s on average, {t['last']:.4g} in "
                     "the last epoch")
    lines += cost_lines
    lines += [f"{name}: not drawn: {why}" for name, why in skipped.items()]
    return lines


def report_run(run_dir: str, price=None) -> int:
    from ..hpo import cost

    records = epoch_records(run_dir)
    costs = cost.run_summary(run_dir, price)
    out = os.path.join(run_dir, "report")
    os.makedirs(out, exist_ok=True)
    summary = summarise(run_dir, records, costs)
    skipped = plots(out, records, costs)
    cost_lines = cost.run_lines(costs, price)
    lines = text_lines(summary, cost_lines, skipped)
    lines.append(f"page: {os.path.join(run_dir, 'index.html')} (open it in a browser)")
    atomic_write_text(os.path.join(out, "summary.txt"), "\n".join(lines) + "\n")
    atomic_write_text(os.path.join(out, "summary.json"), json.dumps(summary, indent=2))
    from .page import run_page

    run_page(run_dir, summary, records, lines, cost_lines, costs)
    print("\n".join(lines))
    print(f"report in {out}")
    return 0


def plots(out: str, records: List[dict], costs: dict) -> Dict[str, str]:
    """Draws the PNGs into ``out``; returns {file: why} for those not drawn (an older
    report's copy is removed, so that what is there is this run's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    skipped = {}

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=80)
        plt.close(fig)

    def skip(name, why):
        skipped[name] = why
        if os.path.exists(os.path.join(out, name)):
            os.unlink(os.path.join(out, name))

    if not records:
        for name in ("losses.png", "physics.png", "throughput.png", "cost.png", "noise_scale.png"):
            skip(name, "no epoch records")
        return skipped

    losses, others = loss_keys(records), other_val_keys(records)
    fig, axes = plt.subplots(1, 1 + bool(others), figsize=(6.5 * (1 + bool(others)), 4.5),
                             squeeze=False)
    ax = axes[0][0]
    bases = sorted({k.split("_", 1)[1] for k in losses})  # train_X and val_X: one colour
    for key in losses:
        colour = f"C{bases.index(key.split('_', 1)[1]) % 10}"
        ax.plot(*series(records, key), "o-" if key.startswith("val_") else "s--", ms=3,
                color=colour, label=key)
    _log_if_wide(ax, [v for k in losses for v in series(records, k)[1]])
    ax.set(xlabel="epoch", ylabel="loss", title="losses per epoch")
    _epoch_ticks(ax)
    ax.legend(fontsize=8)
    if others:
        ax = axes[0][1]
        for key in others:
            ax.plot(*series(records, key), "o-", ms=3, label=key)
        ax.set(xlabel="epoch", ylabel="value", title="other validation metrics")
        _epoch_ticks(ax)
        ax.legend(fontsize=8)
    save(fig, "losses.png")

    names = floored_metrics(records)
    if names:
        cols = min(3, len(names))
        rows = math.ceil(len(names) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
        for ax, name in zip(axes.flat, names):
            ax.plot(*series(records, name), "o-", ms=4, label=name)
            ax.plot(*series(records, name + FLOOR), "k--", lw=1,
                    label=f"{name}{FLOOR} (MC vs MC)")
            ratio = series(records, name + "_ratio")[1]
            ax.set(xlabel="epoch", ylabel=name,
                   title=f"{name} against its floor"
                   + (f" (last ratio {ratio[-1]:.3g})" if ratio else ""))
            _log_if_wide(ax, series(records, name)[1] + series(records, name + FLOOR)[1])
            _epoch_ticks(ax)
            ax.legend(fontsize=8)
        for ax in list(axes.flat)[len(names):]:
            ax.set_visible(False)
        save(fig, "physics.png")
    else:
        skip("physics.png", "no metric with a floor (<name>_floor) in metrics.jsonl; the 3DGAN "
                            "logs them with train.validate_every")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    ax1.plot(*series(records, "samples_per_s"), "o-", ms=4)
    ax1.set(xlabel="epoch", ylabel="samples / s (all ranks)", title="throughput")
    ax1.set_ylim(bottom=0)
    _epoch_ticks(ax1)
    epochs = [r["epoch"] for r in records]
    bottom = [0.0] * len(records)
    for part in ("compute", "allreduce", "data"):
        # the rank mean: time_per_rank where the record has it, else rank 0's split
        vals = [_rank_mean(r, part) for r in records]
        ax2.bar(epochs, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set(xlabel="epoch", ylabel="seconds (mean over ranks)",
            title="where an epoch's training time went")
    _epoch_ticks(ax2)
    ax2.legend(fontsize=8)
    save(fig, "throughput.png")

    from ..hpo.cost import KINDS, UNITS

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2),
                                   gridspec_kw={"width_ratios": [2, 1]})
    unit = UNITS["gpu" if records[-1].get("device") == "gpu" else "cpu"]
    ax1.bar(epochs, [r.get("device_hours", 0.0) for r in records])
    ax1.set(xlabel="epoch", ylabel=unit, title="inside each epoch (ranks x wall)")
    _epoch_ticks(ax1)
    bars = [("inside epochs", costs["in_epochs"])]
    if costs["launched"]:
        bars.append(("launched", costs["launched"]))
    left = [0.0] * len(bars)
    for kind in KINDS:
        vals = [b[1].get(kind, 0.0) for b in bars]
        if any(vals):
            ax2.bar([b[0] for b in bars], vals, bottom=left, label=UNITS[kind])
            left = [a + v for a, v in zip(left, vals)]
    for i, total in enumerate(left):
        ax2.text(i, total, f"{total:.3g}", ha="center", va="bottom", fontsize=8)
    money = costs.get("cost")
    cur = (costs.get("price") or {}).get("currency", "")
    ax2.set(ylabel="device-hours", title="the run" + (f": {money:.4g} {cur}".rstrip()
                                                        if money is not None else ""))
    if any(left):
        ax2.legend(fontsize=8)
    save(fig, "cost.png")
    if not noise_plot(records, plt, save):
        skip("noise_scale.png", "no noise_scale in metrics.jsonl (measured by synchronous "
                                "allreduce runs: train.noise_scale)")
    return skipped


def noise_plot(records: List[dict], plt, save) -> bool:
    """``noise_scale.png``, a panel per optimizer; False where no epoch measured one."""
    names = sorted({k for r in records for k in (r.get("noise_scale") or {})})
    if not names:
        return False
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        for key, label in (("b_simple", "raw"), ("b_pre", "preconditioned")):
            pts = [(r["epoch"], r["noise_scale"][name]) for r in records
                   if _number((r.get("noise_scale") or {}).get(name, {}).get(key))]
            if pts:
                ax.errorbar([e for e, _ in pts], [v[key] for _, v in pts],
                            yerr=[v.get(key + "_err") or 0.0 for _, v in pts], fmt="o-", ms=4,
                            capsize=2, label=f"{label} noise scale")
        batches = [(r["epoch"], r["noise_scale"][name]["global_batch"]) for r in records
                   if "global_batch" in (r.get("noise_scale") or {}).get(name, {})]
        if batches:
            ax.step([e for e, _ in batches], [b for _, b in batches], "k--", lw=1,
                    where="mid", label="global batch")
        ax.set(xlabel="epoch", ylabel="events", yscale="log",
               title=f"{name}: critical batch (above it, ranks cost events)")
        _epoch_ticks(ax)
        ax.legend(fontsize=8)
    save(fig, "noise_scale.png")
    return True


def _rank_mean(record: dict, part: str) -> float:
    per_rank = record.get("time_per_rank")
    if per_rank:
        return sum(t.get(part, 0.0) for t in per_rank) / len(per_rank)
    return (record.get("time") or {}).get(part, 0.0)


def _epoch_ticks(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _log_if_wide(ax, values: List[float]) -> None:
    """A log y axis where positive values span more than two decades (a loss that falls
    from 10 to 0.01 is a line, not a cliff)."""
    positive = [v for v in values if v > 0]
    if positive and len(positive) == len(values) and max(positive) / min(positive) > 100:
        ax.set_yscale("log")
