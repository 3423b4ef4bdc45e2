"""The MLP example with a pause per step, so a test can kill it mid-epoch; ``straggler``
names a rank whose pause is ``straggler_factor`` times longer (a slow node)."""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "models"))
import mlp  # noqa: E402

import mpilearn  # noqa: E402

DEFAULTS = {**mlp.DEFAULTS, "sleep": 0.05, "straggler": -1, "straggler_factor": 5.0}
OWN = ("sleep", "straggler", "straggler_factor")


def build(hparams):
    task = mlp.build({k: v for k, v in hparams.items() if k not in OWN})
    plain_step = task.train_step
    pause = hparams.get("sleep", DEFAULTS["sleep"])
    if mpilearn.rank() == hparams.get("straggler", -1):
        pause *= hparams.get("straggler_factor", DEFAULTS["straggler_factor"])

    def train_step(batch):
        time.sleep(pause)
        return plain_step(batch)

    task.train_step = train_step
    return task
