"""python -m mpilearn.refit RUN: the final model of a sweep.

    mpirun -np N python -m mpilearn.refit runs/hpo [--trial KEY] [--output DIR] [--set K=V]

Trains the best trial's configuration (best by the sweep's objective; ``--trial KEY`` picks
another, and is needed when the sweep had several objectives) on its training data, no fold
held out, as a normal data-parallel run on every rank; then scores the sweep's test files
(``search.test_files``) once with the validation pass (and a GAN's physics numbers).

It never selects or scores on events it trained on: a validation share (the sweep's
``data.val_files``, else ``data.val_fraction``, else ``HOLDOUT``) is held out for the best
epoch (``checkpoints/best.pt``, what generate and export take), early stopping and the
periodic physics validation. With ``--set data.val_fraction=0`` (and no val_files) it trains
on everything and keeps the last epoch, and says so: the best checkpoint, early stopping on a
``val_`` metric and the physics validation are turned off. The output (default ``RUN/refit``) is
a normal training run directory: ``config.yaml`` (the training config used), ``metrics.jsonl``,
``checkpoints/``, ``models/``, ``test.json``; ``RUN/refit.json`` points the sweep's report
(``python -m mpilearn.report RUN``) at it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from ..errors import UsageError
from ..cluster.launcher import RankZeroArgumentParser

POINTER = "refit.json"
HOLDOUT = 0.1  # the validation share held out where the sweep's config has none


def choose_trial(run_dir: str, trial: Optional[str] = None) -> tuple:
    """Rank 0: (sweep config, the chosen trial's done record with its key and params)."""
    import yaml

    from . import objective
    from .journal import Journal
    from ..train.checks import did_you_mean

    paths = [os.path.join(run_dir, n) for n in ("config.yaml", "journal.jsonl")]
    for path in paths:
        if not os.path.exists(path):
            raise UsageError(f"refit: {path} not found (give a sweep's run directory)")
    sweep = yaml.safe_load(open(paths[0])) or {}
    obj = objective.parse(sweep)
    if obj["metrics"] is None:
        raise UsageError(f"refit: the sweep in {run_dir} optimised a function, not a training run")
    state = Journal(paths[1]).replay()
    done = {k: r for k, r in state.finished.items() if r["status"] == "done"}
    if trial is not None:
        if trial not in state.started:
            raise UsageError(f"refit: --trial {trial} is not a trial of {run_dir}"
                             f"{did_you_mean(trial, state.started)}")
        if trial not in done:
            status = state.finished.get(trial, {}).get("status", "in flight")
            raise UsageError(f"refit: trial {trial} is {status}, not done")
    elif not done:
        raise UsageError(f"refit: no trial of {run_dir} is done yet")
    elif len(obj["signs"]) > 1:
        raise UsageError(f"refit: the sweep has {len(obj['signs'])} objectives: choose a trial "
                         f"with --trial KEY (python -m mpilearn.report {run_dir} lists the "
                         "Pareto front)")
    else:
        trial = min(done, key=lambda k: obj["signs"][0] * done[k]["value"])
    return sweep, {**done[trial], "key": trial, "trial": state.started[trial]["trial"],
                   "params": state.started[trial]["params"], "metric": obj["metrics"]}


def training_config(sweep: dict, params: dict, output: str) -> dict:
    """The sweep's training keys with the trial's point applied, a validation share held out
    (see the module doc), the sweep's test files."""
    from ..core.builders import default_hparams
    from .space import apply

    config = {k: v for k, v in sweep.items() if k != "search"}
    config["hparams"] = apply(sweep.get("hparams") or {}, params,
                              default_hparams(sweep["model"]) if sweep.get("model") else None)
    test = (sweep.get("search") or {}).get("test_files") or []
    data = {**sweep.get("data", {}), "test_files": test}
    if not data.get("val_files") and not data.get("val_fraction"):
        data["val_fraction"] = HOLDOUT
    config["data"] = data
    config["output"] = output
    return config


def without_holdout(config: dict) -> list:
    """Where nothing is held out: what would select or score on training events is turned
    off in ``config``; returns the lines saying so."""
    if config["data"]["val_files"] or config["data"]["val_fraction"]:
        return []
    train = config["train"]
    es, best = train["early_stopping"], train["best"]
    if es["patience"] and str(es["monitor"]).startswith("val_"):
        es["patience"] = 0
    best["monitor"] = "none"
    train["validate_every"] = 0
    return ["mpilearn: refit: nothing held out (data.val_fraction 0): trained on every event, "
            "the last epoch is the model (no best-epoch choice, early stopping on val_ metrics "
            "and physics validation off); the test files score it"]


def main(argv=None) -> int:
    p = RankZeroArgumentParser(prog="python -m mpilearn.refit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="the sweep's run directory")
    p.add_argument("--trial", help="the trial's key (journal/trials.csv); default: the best")
    p.add_argument("--output", help="run directory of the refit (default RUN/refit)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a training key of the refit, e.g. train.epochs=20")
    p.add_argument("--resume", nargs="?", const="latest", choices=("latest", "auto"))
    p.add_argument("--overwrite", action="store_true", help="replace an earlier refit")
    p.add_argument("--force", action="store_true", help="with --resume: accept a changed config")
    p.add_argument("--no-progress", action="store_true")
    from ..train.__main__ import add_force_unlock, run

    add_force_unlock(p)
    args = p.parse_args(argv)

    chosen = {}

    def config(ctx):
        from ..core.comm import check_on_root
        from ..core.config import resolve

        found = check_on_root(ctx.comm, choose_trial, args.run_dir, args.trial)
        sweep, trial = ctx.comm.bcast(found, root=0)
        output = args.output or os.path.join(args.run_dir, "refit")
        chosen.update(trial, output=output)
        if ctx.rank == 0:
            scores = ", ".join(f"{m} {v:.5g}" for m, v in zip(trial["metric"], trial["values"]))
            print(f"mpilearn: refit of trial {trial['trial']} ({trial['key']}; cross-validated "
                  f"{scores}): {trial['params']}", flush=True)
        resolved = resolve(None, args.set, base=training_config(sweep, trial["params"], output))
        for line in without_holdout(resolved):
            if ctx.rank == 0:
                print(line, flush=True)
        if ctx.rank == 0 and not resolved["data"]["val_files"] and resolved["data"]["val_fraction"]:
            print(f"mpilearn: refit: {resolved['data']['val_fraction']:g} of the training events "
                  "held out: the best epoch is chosen on them, not on events it trained on",
                  flush=True)
        return resolved

    def record(ctx, last):
        if ctx.rank == 0:
            from ..core.io import atomic_write_text

            done = {**{k: chosen[k] for k in ("output", "trial", "key", "params", "values")},
                    "test": last.get("test")}
            atomic_write_text(os.path.join(args.run_dir, POINTER), json.dumps(done, indent=1))

    return run(args, config, record)


if __name__ == "__main__":
    sys.exit(main())
