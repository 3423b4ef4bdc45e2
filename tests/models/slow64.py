"""tests/models/slow.py in float64, so that runs compare bit for bit in double precision."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import slow  # noqa: E402

DEFAULTS = slow.DEFAULTS


def build(hparams):
    task = slow.build(hparams)
    task.model.double()  # in place: the optimizer keeps the same parameters
    task.dtype = torch.float64
    return task
