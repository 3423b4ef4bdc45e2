"""The MLP example, but rank 1 fails at its third training step: it raises, or with
``hparams.exit_code`` it calls ``sys.exit(exit_code)``."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "models"))
import mlp  # noqa: E402

import mpilearn  # noqa: E402


def build(hparams):
    hparams = dict(hparams)
    exit_code = hparams.pop("exit_code", None)
    task = mlp.build(hparams)
    plain_step = task.train_step
    calls = {"n": 0}

    def train_step(batch):
        calls["n"] += 1
        if mpilearn.rank() == 1 and calls["n"] == 3:
            if exit_code is not None:
                sys.exit(exit_code)
            raise RuntimeError("deliberate failure at step 3")
        return plain_step(batch)

    task.train_step = train_step
    return task
