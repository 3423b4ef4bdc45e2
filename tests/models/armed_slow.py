"""tests/models/slow.py with elastic_mlp's MPILEARN_TEST_KILL / MPILEARN_TEST_STOP hooks on its
steps, and no collective of its own: a sweep's folds (elastic_mlp's counter sums over the job,
not over a fold)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import elastic_mlp  # noqa: E402
import slow  # noqa: E402

DEFAULTS = slow.DEFAULTS


def build(hparams):
    return elastic_mlp.arm(slow.build(hparams))
