"""tests/models/slow64.py that writes down every event it trains on: each process appends one
line of event indices per finished training step to ``$MPILEARN_TEST_EVENTS/events-<pid>.txt``,
so a test can count how often each event of an epoch was trained (an environment variable, not a
hyperparameter: a resume must not change what is trained). With ``MPILEARN_TEST_CRASH_AT=N``
rank 1 raises before its N-th step, once (``crashed`` in that folder marks it done); the line is
written after the step, so a step that a crash cut short is not counted."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import slow64  # noqa: E402

import mpilearn  # noqa: E402

DEFAULTS = slow64.DEFAULTS


def build(hparams):
    task = slow64.build(hparams)
    folder = os.environ.get("MPILEARN_TEST_EVENTS")
    if not folder:
        return task
    plain_step = task.train_step
    crash_at = int(os.environ.get("MPILEARN_TEST_CRASH_AT", "0"))
    marker = os.path.join(folder, "..", "crashed")
    calls = {"n": 0}

    def train_step(batch):
        calls["n"] += 1
        if crash_at and calls["n"] == crash_at and mpilearn.rank() == 1 \
                and not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError(f"deliberate crash before step {crash_at}")
        losses = plain_step(batch)
        with open(os.path.join(folder, f"events-{os.getpid()}.txt"), "a") as f:
            f.write(" ".join(map(str, batch["_index"].tolist())) + "\n")
        return losses

    task.train_step = train_step
    return task
