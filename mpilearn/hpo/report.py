"""python -m mpilearn.report RUN_DIR [--gpu-hour P] [--cpu-hour P] [--currency C] [--site S]:
what a sweep found, from its journal, and what it cost; for a training run's directory, its
curves, physics, throughput and cost (``train/report.py``).

Cost (``hpo/cost.py``): device-hours by kind (GPU-hours, CPU-rank-hours) inside the trials
and launched (every rank from its start to its end), per epoch, per trial, in total and up to
the best trial; with a price per device kind (the options, or the site profile's ``price``),
in money.

Writes into RUN_DIR/report/:

- ``best.json``: counts by status, the best trial (one objective) or the Pareto front (several),
  parameter importances, block utilisation, suggestion origins, and the refit (its directory,
  trial and test scores) once ``python -m mpilearn.refit`` ran;
- ``trials.csv``: one row per trial, numbered as the journal numbers them (the plots use the same
  numbers): status, objective value(s), std and per-fold values, the step a pruned trial stopped
  at, wall time, origin, parameters, failure reason;
- ``convergence.png``: every trial's value and the best so far, by trial number;
- ``parameters.png``: the objective against each parameter (log axes for log-scale parameters,
  integer ticks for integer ones);
- ``intermediate.png``: each trial's per-epoch value (mean over its folds), pruned ones marked
  (not drawn, and said so, when no trial reported one: a sweep without a pruner);
- ``importance.png``: parameter importance (a random forest's impurity importance, scikit-learn);
- ``pareto.png`` (several objectives): every trial in the first two objectives, the front joined;
- ``utilisation.png``: the block timeline; utilisation counts only the time jobs ran (the gaps
  between a stopped job and its resume are left out);

and ``RUN_DIR/index.html``: the summary, the trials, every plot and the config on one page
(``train/page.py``).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from collections import Counter

import numpy as np

from . import cost
from .journal import Journal
from ..errors import UsageError
from ..core.io import atomic_write_text, read_jsonl


def trials(run_dir: str, lost=()):
    """One row per trial; ``lost``: the sweep's :func:`lost_blocks`, whose trials ran again."""
    state = Journal(os.path.join(run_dir, "journal.jsonl")).replay()
    lost = {e["key"]: e for e in lost if e.get("key")}
    rows = []
    for key in state.order:
        start, end = state.started[key], state.finished.get(key) or {}
        values = end.get("values", [end["value"]] if end.get("value") is not None else None)
        rows.append({"trial": start["trial"], "key": key, "params": start["params"],
                     "status": end.get("status", "in flight"), "values": values,
                     "value": values[0] if values and end.get("status") == "done" else None,
                     "std": end.get("std"), "fold_values": end.get("fold_values"),
                     "step": end.get("step"), "wall": end.get("wall"),
                     "origin": start.get("origin", ""), "reason": end.get("reason", ""),
                     # run again after its block was lost under it (from its folds' checkpoints)
                     "requeued_after": (f"block {lost[key]['block']} lost: {lost[key]['reason']}"
                                        if key in lost else "")})
    return sorted(rows, key=lambda r: r["trial"])


def state_trial(rows, key):
    """The trial number of ``key`` as trials.csv numbers it (None: no such trial)."""
    return next((r["trial"] for r in rows if r["key"] == key), None)


def lost_blocks(events) -> list:
    """Every block lost under the sweep (``block_lost``): block, reason, time, and the key of
    the trial it was running (its ``interrupted`` event with that reason), if any."""
    out = []
    for i, e in enumerate(events):
        if e["event"] != "block_lost":
            continue
        stopped = next((x for x in events[i + 1:] if x["event"] == "interrupted"
                        and x.get("block") == e["block"] and x.get("reason") == e["reason"]),
                       None)
        out.append({"block": e["block"], "reason": e["reason"], "time": e.get("time"),
                    "key": stopped["key"] if stopped else None})
    return out


def utilisation(run_dir: str):
    """Per block: (start, end) intervals of trials; and busy time over the time the sweep's
    jobs ran (each job from its start to its last event) times the blocks."""
    events = read_jsonl(os.path.join(run_dir, "journal.jsonl"))
    starts, spans, jobs = {}, {}, []
    seen_blocks = len({e["block"] for e in events if e["event"] == "started"}) or 1
    for e in events:
        kind = e["event"]
        if kind == "job" or not jobs:  # journals from before 'job' events: one job
            jobs.append([e["time"], e["time"], e.get("blocks", seen_blocks)])
        jobs[-1][1] = e["time"]
        if kind == "started":
            starts[e["key"]] = (e["time"], e["block"])
        elif kind in ("done", "failed", "pruned", "interrupted") and e["key"] in starts:
            t0, block = starts.pop(e["key"])
            spans.setdefault(block, []).append((t0, e["time"]))
    if not spans:
        return spans, None
    busy = sum(e - s for v in spans.values() for s, e in v)
    capacity = sum((t1 - t0) * blocks for t0, t1, blocks in jobs)
    return spans, busy / capacity if capacity > 0 else None


def pareto_front(rows, signs):
    """The done trials that no other done trial dominates (in minimised terms)."""
    done = [r for r in rows if r["status"] == "done"]
    loss = [np.array(r["values"]) * signs for r in done]
    return [r for i, r in enumerate(done)
            if not any(np.all(o <= loss[i]) and np.any(o < loss[i]) for o in loss)]


def importance(rows, space):
    """Random-forest impurity importance of each parameter for the (first) objective, on the
    unit-cube encoding of the done trials; None with fewer than 5 of them."""
    done = [r for r in rows if r["status"] == "done"]
    if len(done) < 5 or space is None:
        return None
    from sklearn.ensemble import RandomForestRegressor

    X = np.array([space.encode(r["params"]) for r in done])
    y = np.array([r["values"][0] for r in done])
    forest = RandomForestRegressor(n_estimators=200, random_state=0).fit(X, y)
    return dict(zip(space.names, map(float, forest.feature_importances_)))


def refit(run_dir: str):
    """The sweep's final model (``python -m mpilearn.refit``): where, which trial, test scores."""
    path = os.path.join(run_dir, "refit.json")
    return json.load(open(path)) if os.path.exists(path) else None


def _space(run_dir):
    import yaml

    from .space import Space

    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        return None, ["minimize"]
    config = yaml.safe_load(open(path))
    s = config.get("search", {})
    try:
        space = Space.from_config(s.get("space") or {})
    except Exception:  # a report never fails on an old or odd config
        space = None
    directions = (s.get("objective") or {}).get("direction", "minimize")
    return space, directions if isinstance(directions, list) else [directions]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpilearn.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--gpu-hour", type=float, metavar="PRICE",
                   help="price of one GPU-hour (a GPU rank's hour): costs in money")
    p.add_argument("--cpu-hour", type=float, metavar="PRICE",
                   help="price of one CPU-rank-hour (a CPU rank's hour, its cores included)")
    p.add_argument("--currency", default=None, help="the prices' currency, e.g. USD")
    p.add_argument("--price", help=argparse.SUPPRESS)  # the old one-number form: refused
    p.add_argument("--site", help="site profile (YAML) whose 'price' ({gpu_hour, cpu_hour, "
                                  "currency}) is used where the options above are not given")
    args = p.parse_args(argv)
    try:
        price = _price(args)
    except UsageError as err:
        sys.stderr.write(f"mpilearn: error: {err}\n")
        return 2
    if not os.path.exists(os.path.join(args.run_dir, "journal.jsonl")):
        if os.path.exists(os.path.join(args.run_dir, "metrics.jsonl")):  # a training run
            from ..train.report import report_run

            return report_run(args.run_dir, price)
        sys.stderr.write(f"mpilearn: error: {args.run_dir}: neither journal.jsonl (a sweep) "
                         "nor metrics.jsonl (a training run) found\n")
        return 2
    out = os.path.join(args.run_dir, "report")
    os.makedirs(out, exist_ok=True)
    events = read_jsonl(os.path.join(args.run_dir, "journal.jsonl"))
    lost = lost_blocks(events)
    rows = trials(args.run_dir, lost)
    space, directions = _space(args.run_dir)
    n_obj = max([len(r["values"]) for r in rows if r["status"] == "done" and r["values"]]
                or [1])
    if len(directions) == 1:
        directions = directions * n_obj
    signs = np.array([1.0 if d == "minimize" else -1.0 for d in directions])
    names = sorted({k for r in rows for k in r["params"]})
    done = [r for r in rows if r["status"] == "done"]
    best = min(done, key=lambda r: signs[0] * r["value"]) if done and n_obj == 1 else None
    costs = cost.sweep_summary(args.run_dir, rows, events, best, price)
    with open(os.path.join(out, "trials.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["trial", "key", "status", "value", "values", "std", "fold_values",
                    "pruned_at_step", "wall_s", "device_hours", "cost", "origin", *names,
                    "reason", "requeued_after"])
        for r in rows:
            w.writerow([r["trial"], r["key"], r["status"], r["value"], json.dumps(r["values"]),
                        r["std"], json.dumps(r["fold_values"]), r["step"], r["wall"],
                        r["device_hours"], r["cost"],
                        r["origin"], *[r["params"].get(n) for n in names],
                        r["reason"].splitlines()[0] if r["reason"] else "", r["requeued_after"]])
    front = pareto_front(rows, signs) if n_obj > 1 else []
    spans, util = utilisation(args.run_dir)
    weights = importance(rows, space)
    summary = {"trials": len(rows), **Counter(r["status"] for r in rows),
               "directions": list(directions),
               "best": best and {k: best[k] for k in ("trial", "key", "value", "std", "params")},
               "pareto": [{k: r[k] for k in ("trial", "key", "values", "params")} for r in front],
               "importance": weights, "block_utilisation": util,
               "origins": dict(Counter(r["origin"] or "requeued" for r in rows)),
               "lost_blocks": [{k: b[k] for k in ("block", "reason", "time")}
                               | {"trial": state_trial(rows, b["key"])} for b in lost],
               "refit": refit(args.run_dir), "cost": costs}
    atomic_write_text(os.path.join(out, "best.json"), json.dumps(summary, indent=2))
    skipped = plots(out, rows, done, names, space, directions, signs, front, spans, util,
                    weights, events, objective_labels(args.run_dir, directions),
                    _search_config(args.run_dir).get("pruner", "none"))
    lines = [f"lost block {b['block']}: {b['reason']}"
             + (f"; its trial {state_trial(rows, b['key'])} ran again on another block"
                if b["key"] else "") for b in lost]
    if best:
        lines.append(f"best {best['value']:.6g} +- {best['std']:.2g}: {best['params']} "
                     f"(trial {best['trial']})")
    if front:
        lines.append(f"Pareto front: {len(front)} trial(s): {sorted(r['trial'] for r in front)}")
    if summary["refit"]:
        r = summary["refit"]
        scores = {k: v for k, v in (r.get("test") or {}).items()
                  if k.startswith("test_") and isinstance(v, float)}
        lines.append(f"refit: {r['output']} (trial {r['trial']}"
                     + "".join(f"; {k} {v:.5g}" for k, v in scores.items()) + ")")
    lines += cost.sweep_lines(costs, price)
    lines += [f"{name}: not drawn: {why}" for name, why in skipped.items()]
    lines.append(f"page: {os.path.join(args.run_dir, 'index.html')} (open it in a browser)")
    from ..train.page import sweep_page

    sweep_page(args.run_dir, summary, rows, names, lines)
    print("\n".join(lines))
    print(f"{len(rows)} trials; report in {out}")
    return 0


def _price(args):
    """The price per device kind: --gpu-hour/--cpu-hour/--currency over the site
    profile's ``price`` (``cost.price_from_site``); None: none."""
    if args.price is not None:
        raise UsageError("--price is per device kind now: give --gpu-hour and/or --cpu-hour "
                         "(and --currency), or a site profile's price: {gpu_hour, cpu_hour, "
                         "currency}")
    site = {}
    if args.site:
        from ..cluster.jobs import load_site

        if not os.path.isfile(args.site):
            raise UsageError(f"--site {args.site}: no such file")
        site = load_site(args.site, {})["price"]  # checked there (cluster/price.py)
    given = {"gpu_hour": args.gpu_hour, "cpu_hour": args.cpu_hour, "currency": args.currency}
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return cost.price_from_site(site, args.site)
    return cost.price_from_site({**site, **given}, "command line")


def _search_config(run_dir: str) -> dict:
    """The sweep's ``search`` section as saved in its run directory ({} if none)."""
    from ..core.config import load_file

    path = os.path.join(run_dir, "config.yaml")
    return (load_file(path).get("search") or {}) if os.path.exists(path) else {}


def objective_labels(run_dir: str, directions) -> list:
    """Each objective's axis label: its metric (or function) and mode, and the direction."""
    obj = _search_config(run_dir).get("objective") or {}
    if obj.get("function"):
        metrics = [f"{obj['function']}()"] * len(directions)
    else:
        metric = obj.get("metric") or "val_loss"
        metrics = metric if isinstance(metric, list) else [metric] * len(directions)
        mode = obj.get("mode", "final")
        metrics = [f"{m}, {mode} epoch" for m in metrics]
    return [f"{m} ({d})" for m, d in zip(metrics, directions)]


def plots(out, rows, done, names, space, directions, signs, front, spans, util, weights, events,
          labels=None, pruner="none") -> dict:
    """Draws the plots into ``out``; returns {file: why} for those not drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    labels = labels or [f"objective ({d})" for d in directions]
    label = labels[0]

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=80)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    numbers = [r["trial"] for r in rows]
    vals = np.array([r["value"] if r["status"] == "done" else np.nan for r in rows], float)
    loss = np.where(np.isnan(vals), np.inf, signs[0] * vals)
    best_so_far = signs[0] * np.minimum.accumulate(loss) if len(loss) else loss
    ax.plot(numbers, vals, "o", alpha=0.5, label="trial")
    ax.step(numbers, np.where(np.isinf(best_so_far), np.nan, best_so_far), where="post",
            label="best so far")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="trial (as numbered in trials.csv)", ylabel=label)
    ax.legend()
    save(fig, "convergence.png")

    params = {p.name: p for p in space.params} if space is not None else {}
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(4 * max(1, len(names)), 3.8),
                             squeeze=False)
    for ax, name in zip(axes[0], names):
        xs = [r["params"][name] for r in done]
        ys = [r["value"] for r in done]
        spec = params.get(name)
        if spec is not None and spec.type == "categorical" or (xs and isinstance(xs[0], str)):
            cats = sorted(set(map(str, xs)))
            ax.boxplot([[y for x, y in zip(xs, ys) if str(x) == c] for c in cats])
            ax.set_xticks(range(1, len(cats) + 1), cats)
        else:
            ax.scatter(xs, ys, s=14)
            if spec is not None and spec.log:
                log_axis(ax, spec.low, spec.high)
            if spec is not None and spec.type == "int":
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel=name, ylabel=label)
    fig.suptitle(f"objective {label} vs each parameter")
    save(fig, "parameters.png")

    curves = {}
    for e in events:
        if e["event"] == "progress":
            curves.setdefault(e["key"], {}).setdefault(e["epoch"], []).append(e["value"])
    skipped = {}
    if curves:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        status = {r["key"]: r["status"] for r in rows}
        for key, by_step in curves.items():
            steps = sorted(by_step)
            pruned = status.get(key) == "pruned"
            ax.plot(steps, [np.mean(by_step[s]) for s in steps], "-", lw=1,
                    color="tab:red" if pruned else "tab:blue", alpha=0.6)
        ax.plot([], [], color="tab:blue", label="complete")
        ax.plot([], [], color="tab:red", label="pruned")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="epoch (step)", ylabel="value (mean over folds)",
               title="intermediate values")
        ax.legend()
        save(fig, "intermediate.png")
    else:  # an empty plot with made-up ticks says less than a line
        path = os.path.join(out, "intermediate.png")
        if os.path.exists(path):  # an older report's
            os.unlink(path)
        skipped["intermediate.png"] = "no intermediate values" + (
            " (no pruner)" if pruner == "none" else " reported yet")

    fig, ax = plt.subplots(figsize=(6, 0.5 * max(2, len(names)) + 1.5))
    if weights:
        order = sorted(weights, key=weights.get)
        ax.barh(order, [weights[n] for n in order])
    ax.set(xlabel="importance (random forest)",
           title="parameter importance" + ("" if weights else ": too few done trials"))
    save(fig, "importance.png")

    if len(signs) > 1:
        fig, ax = plt.subplots(figsize=(6, 5))
        ax.scatter([r["values"][0] for r in done], [r["values"][1] for r in done], s=14,
                   alpha=0.5, label="trial")
        pts = sorted((r["values"][0], r["values"][1]) for r in front)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color="tab:red",
                label="Pareto front")
        ax.set(xlabel=labels[0], ylabel=labels[1])
        ax.legend()
        save(fig, "pareto.png")

    fig, ax = plt.subplots(figsize=(9, 0.6 * max(2, len(spans)) + 1.5))
    draw_utilisation(ax, spans, util, lost_blocks(events))
    save(fig, "utilisation.png")
    return skipped


def draw_utilisation(ax, spans: dict, util, lost=()) -> None:
    """The block timeline: one row per block (integer ticks, one per block up to 20), each
    trial a bar with a white edge, so that back-to-back trials stay apart; a lost block
    (``lost_blocks``) a red cross where it was lost."""
    from matplotlib.ticker import MaxNLocator

    t0 = min((s for v in spans.values() for s, _ in v), default=0)
    for block, intervals in sorted(spans.items()):
        ax.broken_barh([(s - t0, e - s) for s, e in intervals], (block - 0.4, 0.8),
                       edgecolor="white", linewidth=0.5)
    marked = [b for b in lost if b.get("time") is not None]
    if marked:
        ax.plot([b["time"] - t0 for b in marked], [b["block"] for b in marked], "x",
                color="tab:red", markersize=12, markeredgewidth=2.5)
    blocks = sorted(set(spans) | {b["block"] for b in marked}) or [0]
    if len(blocks) <= 20:
        ax.set_yticks(blocks)
    else:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(blocks[-1] + 0.6, blocks[0] - 0.6)  # block 0 on top, as a timeline reads
    title = f"block utilisation {util:.1%} (while jobs ran)" if util is not None \
        else "block utilisation"
    if marked:
        title += f"; red x: {len(marked)} block(s) lost, each trial ran again on another"
    ax.set(xlabel="seconds since the first trial", ylabel="block", title=title)


def log_axis(ax, low: float, high: float) -> None:
    """A log x axis a reader can read over a log parameter's range (``low``..``high``): its
    limits, and labelled ticks at 1-2-5 (under three decades; every digit under one decade)
    instead of the one power of ten a narrow range holds."""
    import math

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    decades = math.log10(high / low)
    subs = (1.0,) if decades > 3 else (1.0, 2.0, 5.0) if decades >= 1 else \
        tuple(float(d) for d in range(1, 10))
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())  # labelled minor ticks overlap
    pad = (high / low) ** 0.04
    ax.set_xlim(low / pad, high * pad)



if __name__ == "__main__":
    sys.exit(main())
