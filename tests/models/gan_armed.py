"""The 3DGAN (models/gan3d.py) with tests/models/elastic_mlp.py's kill and stop switches."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "models"))
import elastic_mlp  # noqa: E402
import gan3d  # noqa: E402

DEFAULTS = gan3d.DEFAULTS


def build(hparams):
    return elastic_mlp.arm(gan3d.build(hparams))
