"""Calorimeter data: the two 3DGAN HDF5 formats, their preprocessing and the measured angle.

Formats (reference 3dgan.md §3b):
  angle  ``ECAL`` (N,51,51,25) in GeV x 50, ``energy`` (N,) GeV, ``theta`` rad, optional
         ``mtheta`` (measured angle) and ``sum``.
  fixed  ``ECAL`` (N,25,25,25) in GeV, ``target`` (N,k) with the energy in column 1 (or an
         ``energy`` key).
Preprocessing (§2d) turns raw events into what the GAN sees: thresholds, the Σ > 10 event filter
(angle), energy label E/100, the un-powered cell sum as the ``ecal`` label, and x^0.85 (angle)
or x 100 (fixed) pixel scaling.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import UsageError

GEOMETRY = {
    "angle": {"shape": (51, 51, 25), "unit": 50.0, "power": 0.85, "xscale": 1.0,
              "threshold": 1e-4, "min_sum": 10.0},
    "fixed": {"shape": (25, 25, 25), "unit": 1.0, "power": 1.0, "xscale": 100.0,
              "threshold": 1e-6, "min_sum": 0.0},
}
EMPTY_ANGLE = 100.0  # what the measured angle is for an event with no energy
# as the reference (measPython / ecal_angle): only a layer or event with exactly no energy is
# empty. Both twins read these constants.
MIN_LAYER_ENERGY = 0.0
POWER = GEOMETRY["angle"]["power"]
# the 25x25x25 model's fake batches: E'/100 ~ U(0.1, 5), i.e. E' ~ U(10, 500) GeV (§2a)
SAMPLED_ENERGY = (0.1, 5.0)


def ecal_fit(energy_label):
    """The reference's GetEcalFit (mod 1) for the 25x25x25 model: the expected cell sum, in
    the model's scaled units, for E/100 = ``energy_label`` (numpy or torch): p(x)·x·xscale,
    p(x) = 0.0018x⁴ − 0.023x³ + 0.11x² − 0.28x + 2.21 (a sampling fraction of 2.18 % at
    10 GeV, 2.02 % at 100 GeV, 1.81 % at 500 GeV)."""
    x = energy_label
    p = (((0.0018 * x - 0.023) * x + 0.11) * x - 0.28) * x + 2.21
    return p * x * GEOMETRY["fixed"]["xscale"]


def measured_angle(images: torch.Tensor, min_energy: float = MIN_LAYER_ENERGY) -> torch.Tensor:
    """§4c: the shower's polar angle measured from an (N, X, Y, Z) image of cell energies.

    Index units with cell centres at i+0.5; per layer, the slope of the layer barycentre's y
    offset from the global barycentre; π/2 - atan(slope), averaged over non-empty layers with
    weight (z+0.5). Differentiable, so the discriminator can use it as a fixed output. Layers
    (and events) with no more than ``min_energy`` count as empty: by default only an exact 0,
    as in the reference (a barycentre of a faint layer is a fine value; its gradient is large).
    """
    n, nx, ny, nz = images.shape
    dev, dt = images.device, images.dtype
    xs = torch.arange(nx, device=dev, dtype=dt) + 0.5
    ys = torch.arange(ny, device=dev, dtype=dt) + 0.5
    zs = torch.arange(nz, device=dev, dtype=dt) + 0.5
    total = images.sum(dim=(1, 2, 3))
    safe_total = torch.where(total > min_energy, total, torch.ones_like(total))
    x_ref = (images.sum(dim=(2, 3)) * xs).sum(1) / safe_total
    y_ref = (images.sum(dim=(1, 3)) * ys).sum(1) / safe_total
    z_ref = (images.sum(dim=(1, 2)) * zs).sum(1) / safe_total
    layer = images.sum(dim=(1, 2))                                   # (N, Z)
    filled = layer > min_energy
    safe_layer = torch.where(filled, layer, torch.ones_like(layer))
    x_mid = (images.sum(dim=2) * xs[:, None]).sum(1) / safe_layer    # (N, Z)
    y_mid = (images.sum(dim=1) * ys[:, None]).sum(1) / safe_layer
    dz = zs[None, :] - z_ref[:, None]
    # sqrt only of safe values: sqrt'(0) is infinite and would poison the gradient (0 x inf),
    # which happens for a shower in a single layer (x_mid = x_ref, z = z_ref)
    dist2 = (x_mid - x_ref[:, None]) ** 2 + dz ** 2
    dist = torch.sqrt(torch.where(dist2 > 1e-12, dist2, torch.ones_like(dist2)))
    slope = (y_mid - y_ref[:, None]) / dist
    slope = torch.where(dz < 0, -slope, slope)
    angle = math.pi / 2 - torch.atan(slope)
    weight = zs[None, :] * filled.to(dt)
    wsum = weight.sum(1)
    mean = (angle * weight).sum(1) / torch.where(wsum > 0, wsum, torch.ones_like(wsum))
    return torch.where(wsum > 0, mean, torch.full_like(mean, EMPTY_ANGLE))


def measured_angle_np(images: np.ndarray, chunk: int = 256) -> np.ndarray:
    out = []
    for start in range(0, len(images), chunk):
        block = torch.as_tensor(np.asarray(images[start:start + chunk], dtype=np.float64))
        out.append(measured_angle(block).numpy())
    return np.concatenate(out) if out else np.zeros(0)


def energy_of(batch: dict) -> np.ndarray:
    """Primary energy in GeV: ``energy`` key, else column 1 of ``target``."""
    if "energy" in batch:
        return np.asarray(batch["energy"], dtype=np.float64).reshape(-1)
    return np.asarray(batch["target"], dtype=np.float64)[:, 1]


class Preprocess:
    """Raw file batch -> GAN batch (runs in the prefetch thread). Checks shapes and values."""

    def __init__(self, geometry: str, angle_key: str = "mtheta", threshold=None):
        if geometry not in GEOMETRY:
            raise UsageError(f"geometry must be one of {', '.join(GEOMETRY)}, got {geometry!r}")
        self.geometry, self.g = geometry, GEOMETRY[geometry]
        self.angle_key = angle_key
        self.threshold = self.g["threshold"] if threshold is None else threshold

    def keys(self):
        required = ["ECAL"]
        optional = ["energy", "target", "theta", "mtheta", "sum"]
        return required, optional

    def __call__(self, batch: dict) -> dict:
        ecal = np.asarray(batch["ECAL"], dtype=np.float32)
        if ecal.shape[1:] != self.g["shape"]:
            raise ValueError(f"ECAL events have shape {ecal.shape[1:]}, expected "
                             f"{self.g['shape']} for geometry '{self.geometry}'")
        if not np.isfinite(ecal).all():
            bad = int((~np.isfinite(ecal.reshape(len(ecal), -1))).any(1).sum())
            raise ValueError(f"ECAL has NaN or infinite cells in {bad} event(s)")
        ecal = np.where(ecal < self.threshold, 0.0, ecal).astype(np.float32)
        energy = energy_of(batch)
        total = ecal.reshape(len(ecal), -1).sum(1)
        keep = total > self.g["min_sum"]
        out = {"_index": np.asarray(batch["_index"])[keep] if "_index" in batch else np.nonzero(keep)[0],
               "energy": (energy[keep] / 100.0).astype(np.float32),
               "ecal": (total[keep] * (self.g["xscale"] if self.geometry == "fixed" else 1.0)).astype(np.float32)}
        images = ecal[keep]
        if self.geometry == "angle":
            if self.angle_key in batch:
                angle = np.asarray(batch[self.angle_key], dtype=np.float64).reshape(-1)[keep]
            else:
                angle = measured_angle_np(images)
            out["angle"] = angle.astype(np.float32)
            images = np.power(images, self.g["power"])
        else:
            images = images * self.g["xscale"]
        out["images"] = images.astype(np.float32)
        return out

    def to_gev(self, images: np.ndarray) -> np.ndarray:
        """Generated (preprocessed) images back to cell energies in GeV."""
        images = np.asarray(images, dtype=np.float64)
        if self.geometry == "angle":
            return np.power(np.maximum(images, 0), 1.0 / self.g["power"]) / self.g["unit"]
        return images / self.g["xscale"]
