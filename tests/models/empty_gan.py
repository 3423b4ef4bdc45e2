"""The small 3DGAN whose generator can only emit empty images (its last bias is -1e3)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "models"))
import gan3d  # noqa: E402

DEFAULTS = gan3d.DEFAULTS


def build(hparams):
    task = gan3d.build({**hparams, "preset": "small"})
    with torch.no_grad():
        task.generator.last.bias.fill_(-1e3)
    return task
