"""The conditions a 3DGAN run was trained on, recorded in ``RUN/training_ranges.json`` when
training starts, so that ``generate`` can refuse to extrapolate silently and ``export`` can
write them beside the model.

A generator is only validated where it saw events: ``generate`` refuses an energy or angle
outside the recorded range (widened by ``SLACK`` of its width each side, so that a run trained
on 100-200 GeV accepts ``--energy 100 200`` although its events' extremes are 100.4 and 199.7),
and an angle that looks like radians where the run was trained in degrees 60-120.
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional

import numpy as np

from ..errors import UsageError

FILE = "training_ranges.json"
SLACK = 0.02
ANGLE_DEFINITION = ("polar angle θ of the primary particle to the calorimeter face (90° = "
                    "normal incidence); --angle and CSV conditions in degrees, HDF5 files and "
                    "the exported model's 'angle' input in rad")
UNITS = {"energy": "GeV (the exported model's 'energy' input: GeV / 100)",
         "angle": "degrees (rad in HDF5 files and the exported model)",
         "cells_gev": "GeV per cell"}


def measure(task, paths) -> dict:
    """The energy (GeV) and angle (degrees) ranges of the events in ``paths``."""
    import h5py

    from ..cluster.stage import local
    from .format import energy_of

    energies, angles = [], []
    key = task.preprocess.angle_key if task.variant == "angle" else None
    for path in paths:
        with h5py.File(local(path), "r") as f:
            raw = {k: f[k][:] for k in ("energy", "target") if k in f}
            energies.append(energy_of(raw))
            if key and key in f:
                angles.append(np.degrees(np.asarray(f[key][:], np.float64).reshape(-1)))
    out = {"variant": task.variant, "files": [str(p) for p in paths],
           "energy_gev": _span(energies), "units": UNITS}
    if task.variant == "angle":
        out.update(angle_deg=_span(angles), angle_key=key, angle_definition=ANGLE_DEFINITION)
    return out


def _span(parts) -> Optional[list]:
    values = np.concatenate(parts) if parts else np.zeros(0)
    values = values[np.isfinite(values)]
    return [float(values.min()), float(values.max())] if len(values) else None


def write(task, paths, output: str) -> None:
    from ..core.io import atomic_write_text

    atomic_write_text(os.path.join(output, FILE), json.dumps(measure(task, paths), indent=1))


def read(run_dir: str) -> Optional[dict]:
    path = os.path.join(run_dir, FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def allowed(span) -> tuple:
    lo, hi = span
    pad = SLACK * (hi - lo)
    return lo - pad, hi + pad


def outside(ranges: dict, energy_gev, angle_deg) -> list:
    """Messages, one per condition outside the recorded ranges (empty: all inside)."""
    problems = []
    for name, values, span, unit in (("energy", energy_gev, ranges.get("energy_gev"), "GeV"),
                                     ("angle", angle_deg, ranges.get("angle_deg"), "°")):
        if values is None or span is None or not len(values):
            continue
        values = np.asarray(values, np.float64)
        lo, hi = allowed(span)
        bad = values[(values < lo) | (values > hi)]
        if len(bad):
            hint = ""
            if name == "angle" and span[0] > 2 * math.pi and np.all(np.abs(values) <= 2 * math.pi):
                hint = (f"; {bad[0]:g} looks like radians: the angle is in degrees "
                        f"({bad[0]:g} rad = {math.degrees(bad[0]):.4g}°)")
            problems.append(f"{name} {bad[0]:g} {unit} is outside the run's training range "
                            f"{span[0]:.4g}-{span[1]:.4g} {unit}{hint}")
    return problems


def check(ranges: Optional[dict], energy_gev, angle_deg, extrapolate: bool, where: str) -> None:
    """UsageError for conditions outside ``ranges`` (``where`` names the run), or with
    ``extrapolate`` one warning on stderr."""
    problems = outside(ranges or {}, energy_gev, angle_deg)
    if not problems:
        return
    if not extrapolate:
        raise UsageError(f"{where}: " + "; ".join(problems)
                         + " (give --extrapolate to generate there anyway)")
    import sys

    print(f"mpilearn: warning: --extrapolate: {'; '.join(problems)}: these showers are "
          "outside what the generator was trained and validated on", file=sys.stderr, flush=True)
