"""The embedded demo job: what ``python -m mpilearn.train --demo`` (and ``make demo``) runs.

The small 3DGAN preset on synthetic showers (``mpilearn.calo.simulate``), generated once by rank 0
into the cache folder, so the demo needs no download. Physics validation runs every epoch. It
lives in calo/, not core/: the core knows no calorimeter (tests/test_layers.py checks it).
"""
from __future__ import annotations

import glob
import os

EVENTS, SEED, ENERGY = 2400, 2026, (100.0, 200.0)


def cache_dir() -> str:
    return os.environ.get("MPILEARN_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "mpilearn"))


def data_dir() -> str:
    return os.path.join(cache_dir(), f"showers-angle-{ENERGY[0]:g}-{ENERGY[1]:g}-{EVENTS}-{SEED}")


def default_config() -> dict:
    return {
        "model": "mpilearn.models.gan3d",  # a module: the same in a checkout and a wheel
        "hparams": {"preset": "small"},
        "data": {"files": [os.path.join(data_dir(), "*.h5")], "val_fraction": 0.15},
        # np > 1: each optimizer's own rule (RMSprop: lr x sqrt(ranks)), reached over the
        # first epoch from the per-rank batch; linear, SGD's rule, trained a worse generator
        # at np = 2 and 4 on the smooth preset (docs: benchmarks, physics and convergence)
        "train": {"epochs": 4, "batch_size": 16, "validate_every": 1, "physics_events": 256,
                  "lr_scaling": "auto", "base_batch": 16, "warmup_epochs": 1},
    }


def ensure_data(comm) -> None:
    """Collective: rank 0 simulates the default dataset if it is not cached yet."""
    from .simulate import simulate

    folder = data_dir()
    if comm.Get_rank() == 0 and not glob.glob(os.path.join(folder, "*.h5")):
        print(f"mpilearn: simulating the default dataset into {folder}", flush=True)
        tmp = folder + ".partial"
        simulate(tmp, EVENTS, "angle", ENERGY, SEED, events_per_file=800)
        os.replace(tmp, folder)  # all files appear at once: a killed run leaves no half set
    comm.Barrier()
