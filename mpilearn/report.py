"""python -m mpilearn.report RUN_DIR: what a sweep found, from its journal.

Writes into RUN_DIR/report/: ``best.json`` (best parameters and value), ``trials.csv`` (one row
per trial: key, status, value, std, per-fold values, wall time, parameters, failure reason),
``convergence.png`` (best-so-far vs trials), ``parameters.png`` (objective vs each parameter:
a one-dimensional partial-dependence view), ``utilisation.png`` (block timeline, with the
measured block utilisation in the title).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys

import numpy as np

from .hpo.journal import Journal
from .io import atomic_write_text, read_jsonl


def trials(run_dir: str):
    state = Journal(os.path.join(run_dir, "journal.jsonl")).replay()
    rows = []
    for key in state.order:
        start, end = state.started[key], state.finished.get(key)
        rows.append({"trial": start["trial"], "key": key, "params": start["params"],
                     "status": end["status"] if end else "in flight",
                     "value": end.get("value") if end else None,
                     "std": end.get("std") if end else None,
                     "fold_values": end.get("fold_values") if end else None,
                     "wall": end.get("wall") if end else None,
                     "reason": end.get("reason", "") if end else ""})
    return rows


def utilisation(run_dir: str):
    """Per block: (start, end) intervals of trials, and busy / elapsed over the sweep."""
    events = read_jsonl(os.path.join(run_dir, "journal.jsonl"))
    starts, spans = {}, {}
    for e in events:
        if e["event"] == "started":
            starts[(e["key"], e["block"])] = e["time"]
        elif e["event"] in ("done", "failed") and (e["key"], e.get("block")) in starts:
            spans.setdefault(e["block"], []).append((starts[(e["key"], e["block"])], e["time"]))
    if not spans:
        return spans, None
    t0 = min(s for v in spans.values() for s, _ in v)
    t1 = max(e for v in spans.values() for _, e in v)
    busy = sum(e - s for v in spans.values() for s, e in v)
    return spans, busy / ((t1 - t0) * len(spans)) if t1 > t0 else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpilearn.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    args = p.parse_args(argv)
    if not os.path.exists(os.path.join(args.run_dir, "journal.jsonl")):
        sys.stderr.write(f"mpilearn: error: {args.run_dir}/journal.jsonl not found\n")
        return 2
    out = os.path.join(args.run_dir, "report")
    os.makedirs(out, exist_ok=True)
    rows = trials(args.run_dir)
    names = sorted({k for r in rows for k in r["params"]})
    with open(os.path.join(out, "trials.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["trial", "key", "status", "value", "std", "fold_values", "wall_s", *names, "reason"])
        for r in rows:
            w.writerow([r["trial"], r["key"], r["status"], r["value"], r["std"],
                        json.dumps(r["fold_values"]), r["wall"],
                        *[r["params"].get(n) for n in names], r["reason"].splitlines()[0] if r["reason"] else ""])
    done = [r for r in rows if r["status"] == "done"]
    best = min(done, key=lambda r: r["value"]) if done else None
    spans, util = utilisation(args.run_dir)
    summary = {"trials": len(rows), "done": len(done),
               "failed": sum(r["status"] == "failed" for r in rows),
               "best": best and {k: best[k] for k in ("key", "value", "std", "params")},
               "block_utilisation": util}
    atomic_write_text(os.path.join(out, "best.json"), json.dumps(summary, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    order = sorted(rows, key=lambda r: r["trial"])
    vals = [r["value"] if r["status"] == "done" else np.nan for r in order]
    best_so_far = np.fmin.accumulate(np.where(np.isnan(vals), np.inf, vals))
    ax.plot(range(1, len(vals) + 1), vals, "o", alpha=0.5, label="trial")
    ax.step(range(1, len(vals) + 1), np.where(np.isinf(best_so_far), np.nan, best_so_far),
            where="post", label="best so far")
    ax.set(xlabel="trial", ylabel="objective (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "convergence.png"), dpi=80)
    plt.close(fig)

    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(4 * max(1, len(names)), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        xs = [r["params"][name] for r in done]
        ys = [r["value"] for r in done]
        if xs and isinstance(xs[0], str):
            cats = sorted(set(xs))
            ax.boxplot([[y for x, y in zip(xs, ys) if x == c] for c in cats])
            ax.set_xticks(range(1, len(cats) + 1), cats)
        else:
            ax.scatter(xs, ys, s=14)
        ax.set(xlabel=name, ylabel="objective")
    fig.suptitle("objective vs each parameter")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "parameters.png"), dpi=80)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 0.6 * max(2, len(spans)) + 1.5))
    t0 = min((s for v in spans.values() for s, _ in v), default=0)
    for block, intervals in sorted(spans.items()):
        ax.broken_barh([(s - t0, e - s) for s, e in intervals], (block - 0.4, 0.8))
    ax.set(xlabel="seconds since the first trial", ylabel="block",
           title=f"block utilisation {util:.1%}" if util is not None else "block utilisation")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "utilisation.png"), dpi=80)
    plt.close(fig)
    if best:
        print(f"best {best['value']:.6g} +- {best['std']:.2g}: {best['params']} (trial {best['trial']})")
    print(f"{len(rows)} trials; report in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
