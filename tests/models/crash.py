"""The MLP example, but rank 1 fails at its third training step: it raises; with
``hparams.exit_code`` it calls ``sys.exit(exit_code)``; with ``hparams.nan_inputs`` its
inputs turn NaN for that step instead; with ``hparams.hang`` (a file name) it creates that
file and sleeps for ever inside the step (the watchdog's case); with ``hparams.kill_first_run``
it kills itself (SIGKILL) in a SLURM job's first run only (a requeued run trains through)."""
import os
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "models"))
import mlp  # noqa: E402

import mpilearn  # noqa: E402


def build(hparams):
    hparams = dict(hparams)
    exit_code = hparams.pop("exit_code", None)
    nan_inputs = hparams.pop("nan_inputs", False)
    hang = hparams.pop("hang", "")
    kill_first_run = hparams.pop("kill_first_run", False)
    task = mlp.build(hparams)
    plain_step = task.train_step
    calls = {"n": 0}

    def train_step(batch):
        calls["n"] += 1
        if mpilearn.rank() == 1 and calls["n"] == 3:
            if kill_first_run:
                if os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
                    os.kill(os.getpid(), signal.SIGKILL)
                return plain_step(batch)
            if hang:
                open(hang, "w").close()
                while True:
                    time.sleep(3600)
            if nan_inputs:
                batch = {**batch, "X": np.full_like(batch["X"], np.nan)}
            elif exit_code is not None:
                sys.exit(exit_code)
            else:
                raise RuntimeError("deliberate failure at step 3")
        return plain_step(batch)

    task.train_step = train_step
    return task
