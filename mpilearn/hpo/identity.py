"""A sweep's identity, guarded like a run's: ``--resume`` accepts changes to how long and how
wide the sweep runs, refuses changes to what its trials are (space, searcher, objective,
folds, data, model, training) unless ``--force``, and keeps every config it accepted.

``config.yaml`` is the current config; ``config-history/NNNN.yaml`` holds each accepted one
(0001 the first). The journal's ``job`` and ``started`` events carry the number of the
config they ran under.
"""
from __future__ import annotations

import glob
import os
from typing import List, Tuple

from ..train.checks import compare_saved

HISTORY = "config-history"
# what a resumed sweep may change: its budget, time limits, width, extra points to try, and
# settings that do not change a trial's training
SAFE_ON_RESUME = {"output", "search.budget", "search.trial_timeout", "search.blocks",
                  "search.enqueue", "data.prefetch", "device.allow_shared_gpus", "train.log",
                  "train.log_every_steps", "train.keep_checkpoints",
                  "train.checkpoint_every_steps", "search.elastic"}


def check(output: str, config: dict, force: bool) -> List[str]:
    """Rank 0, before anything is written: the notes listing the accepted changes; a refused
    change raises UsageError naming the keys."""
    return compare_saved(os.path.join(output, "config.yaml"), config, SAFE_ON_RESUME, force,
                         "what its trials are (budget, trial_timeout, blocks and enqueue may "
                         "change)")


def record(output: str, config: dict) -> Tuple[int, str]:
    """After every check passed: ``config.yaml`` and, when it differs from the last accepted
    one, a new ``config-history`` entry. Returns (number, path) of the config in force."""
    import yaml

    from ..core.config import dump, flatten

    folder = os.path.join(output, HISTORY)
    os.makedirs(folder, exist_ok=True)
    saved = sorted(glob.glob(os.path.join(folder, "[0-9][0-9][0-9][0-9].yaml")))
    current = os.path.join(output, "config.yaml")
    if not saved and os.path.exists(current):  # a sweep from before the history was kept
        with open(current) as f:
            first = yaml.safe_load(f) or {}
        saved = [os.path.join(folder, "0001.yaml")]
        dump(first, saved[0])
    last = None
    if saved:
        with open(saved[-1]) as f:
            last = flatten(yaml.safe_load(f) or {})
    if last != flatten(config):
        saved.append(os.path.join(folder, f"{len(saved) + 1:04d}.yaml"))
        dump(config, saved[-1])
    dump(config, current)
    return len(saved), os.path.relpath(saved[-1], output)
