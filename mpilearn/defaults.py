"""The embedded default job: what ``python -m mpilearn.train`` runs with no config.

Its data is generated once (rank 0) into the cache folder, so the demo needs no download.
"""
from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cache_dir() -> str:
    return os.environ.get("MPILEARN_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "mpilearn"))


def default_config() -> dict:
    data = os.path.join(cache_dir(), "toy", "regression.h5")
    return {
        "model": os.path.join(REPO, "models", "mlp.py"),
        "data": {"files": [data], "val_fraction": 0.2},
        "train": {"epochs": 5, "batch_size": 64, "early_stopping": {"patience": 3}},
    }


def ensure_data(comm) -> None:
    """Collective: rank 0 writes the default dataset if it is not cached yet."""
    from .data.toy import write_regression

    path = default_config()["data"]["files"][0]
    if comm.Get_rank() == 0 and not os.path.exists(path):
        print(f"mpilearn: generating the default dataset in {path}", flush=True)
        write_regression(path, events=16384)
    comm.Barrier()
