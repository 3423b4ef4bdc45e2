"""tests/models/slow64.py that writes down every event it trains on: each process appends one
line of event indices per training step to ``$MPILEARN_TEST_EVENTS/events-<pid>.txt``, so a
test can count how often each event of an epoch was trained (an environment variable, not a
hyperparameter: a resume must not change what is trained)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import slow64  # noqa: E402

DEFAULTS = slow64.DEFAULTS


def build(hparams):
    task = slow64.build(hparams)
    folder = os.environ.get("MPILEARN_TEST_EVENTS")
    if not folder:
        return task
    plain_step = task.train_step

    def train_step(batch):
        with open(os.path.join(folder, f"events-{os.getpid()}.txt"), "a") as f:
            f.write(" ".join(map(str, batch["_index"].tolist())) + "\n")
        return plain_step(batch)

    task.train_step = train_step
    return task
