"""Physics validation of generated showers against Monte Carlo (reference 3dgan.md §4).

Per-event observables are computed where the events are (each rank its share) and gathered to
rank 0, which scores and plots. The score follows §4d's training metric, lower is better:

    score = moments + profiles + angle, each averaged over energy bins, where
    moments  = mean over axes (x, y, z) and moments (barycentre, 2nd central moment) of
               |<m>_MC - <m>_GAN| / |<m>_MC|                 (counted once, not twice as in
               the reference code)
    profiles = mean over axes of  Σ_i |<P_i>_MC - <P_i>_GAN| / Σ_i <P_i>_MC
               (the reference divides cell by cell, which lets near-empty edge cells dominate;
               this content-weighted form keeps two MC samples near 0)
    angle    = mean over events of |θ_MC,meas - θ_GAN,meas| / θ_MC,meas   (angle model only)
"""
from __future__ import annotations

import json
import os
from typing import Dict, Optional

import numpy as np

from .data.calo import measured_angle_np

HIT_THRESHOLD = 2e-4             # GeV
SPECTRUM_BINS = np.logspace(-12, 1, 101)   # GeV
ENERGY_BINS = 4


def features(images_gev: np.ndarray, energy_gev: np.ndarray) -> Dict[str, np.ndarray]:
    """Per-event observables of (N, X, Y, Z) cell energies in GeV."""
    img = np.asarray(images_gev, dtype=np.float64)
    n = len(img)
    total = img.reshape(n, -1).sum(1)
    safe = np.where(total > 0, total, 1.0)
    profiles = [img.sum(axis=(2, 3)), img.sum(axis=(1, 3)), img.sum(axis=(1, 2))]
    moments = np.zeros((n, 3, 2))
    for a, prof in enumerate(profiles):
        pos = np.arange(prof.shape[1]) + 0.5
        m1 = (prof * pos).sum(1) / safe
        m2 = (prof * (pos[None, :] - m1[:, None]) ** 2).sum(1) / safe
        moments[:, a] = np.stack([m1, m2], 1)
    nz = img.shape[3]
    thirds = np.array_split(np.arange(nz), 3)
    return {
        "energy": np.asarray(energy_gev, dtype=np.float64),
        "sum": total,
        "sampling_fraction": total / np.asarray(energy_gev, dtype=np.float64),
        "profile_x": profiles[0], "profile_y": profiles[1], "profile_z": profiles[2],
        "moments": moments,
        "max_position": np.stack([p.argmax(1) for p in profiles], 1),
        "hits": (img > HIT_THRESHOLD).reshape(n, -1).sum(1),
        "long_ratio": np.stack([profiles[2][:, t].sum(1) for t in thirds], 1) / safe[:, None],
        "angle": measured_angle_np(img),
        "spectrum": np.stack([np.histogram(e[e > 0], SPECTRUM_BINS)[0] for e in img.reshape(n, -1)]),
    }


def concat(parts) -> Dict[str, np.ndarray]:
    parts = [p for p in parts if p and len(p["energy"])]
    if not parts:
        return {}
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def energy_bins(energy: np.ndarray, n_bins: int = ENERGY_BINS, min_events: int = 10):
    """Masks of equal-width energy bins holding at least ``min_events`` MC events."""
    edges = np.linspace(energy.min(), energy.max() + 1e-9, n_bins + 1)
    masks = [(energy >= lo) & (energy < hi) for lo, hi in zip(edges[:-1], edges[1:])]
    masks = [m for m in masks if m.sum() >= min_events]
    return masks or [np.ones_like(energy, dtype=bool)]


def _rel(a, b):
    return np.abs(a - b) / np.maximum(np.abs(a), 1e-12)


def score(mc: Dict[str, np.ndarray], gan: Dict[str, np.ndarray], with_angle: bool = True) -> dict:
    """The single-number score and its three terms; mc and gan are paired event by event."""
    terms = {"moments": [], "profiles": [], "angle": []}
    for mask in energy_bins(mc["energy"]):
        terms["moments"].append(_rel(mc["moments"][mask].mean(0), gan["moments"][mask].mean(0)).mean())
        prof = []
        for axis in "xyz":
            a = mc[f"profile_{axis}"][mask].mean(0)
            b = gan[f"profile_{axis}"][mask].mean(0)
            prof.append(np.abs(a - b).sum() / max(a.sum(), 1e-12))
        terms["profiles"].append(np.mean(prof))
        if with_angle:
            terms["angle"].append(_rel(mc["angle"][mask], gan["angle"][mask]).mean())
    out = {k: float(np.mean(v)) for k, v in terms.items() if v}
    out["score"] = float(sum(out.values()))
    sf_mc, sf_gan = mc["sampling_fraction"].mean(), gan["sampling_fraction"].mean()
    out["sampling_fraction_mc"], out["sampling_fraction_gan"] = float(sf_mc), float(sf_gan)
    out["sampling_fraction_mre"] = float(abs(sf_mc - sf_gan) / sf_mc)
    out["events"] = int(len(mc["energy"]))
    return out


def plot(mc: Dict[str, np.ndarray], gan: Dict[str, np.ndarray], folder: str,
         label: str = "GAN") -> list:
    """PNG plots of generated vs MC: profiles, sampling fraction, spectra; returns paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    paths = []
    fig, axes = plt.subplots(2, 3, figsize=(14, 8))
    for col, axis in enumerate("xyz"):
        for row, log in enumerate((False, True)):
            ax = axes[row, col]
            for data, name, style in ((mc, "MC", "-"), (gan, label, "--")):
                prof = data[f"profile_{axis}"].mean(0)
                ax.plot(np.arange(len(prof)), prof, style, label=name)
            ax.set_xlabel(f"{axis} cell" if axis != "z" else "layer")
            ax.set_ylabel("mean energy (GeV)")
            if log:
                ax.set_yscale("log")
            ax.legend()
    fig.suptitle("shower shapes")
    fig.tight_layout()
    paths.append(os.path.join(folder, "profiles.png"))
    fig.savefig(paths[-1], dpi=80)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 5))
    for data, name, marker in ((mc, "MC", "o"), (gan, label, "x")):
        ax.scatter(data["energy"], data["sampling_fraction"], s=6, marker=marker, label=name, alpha=0.6)
        edges = np.linspace(mc["energy"].min(), mc["energy"].max() + 1e-9, 11)
        idx = np.digitize(data["energy"], edges) - 1
        means = [data["sampling_fraction"][idx == i].mean() if (idx == i).any() else np.nan
                 for i in range(10)]
        ax.plot(0.5 * (edges[1:] + edges[:-1]), means, "-" if name == "MC" else "--", lw=2)
    ax.set_xlabel("primary energy (GeV)")
    ax.set_ylabel("sampling fraction")
    ax.set_ylim(0.0, 0.04)
    ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(folder, "sampling_fraction.png"))
    fig.savefig(paths[-1], dpi=80)
    plt.close(fig)

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.5))
    centers = np.sqrt(SPECTRUM_BINS[1:] * SPECTRUM_BINS[:-1])
    for data, name in ((mc, "MC"), (gan, label)):
        axes[0].step(centers, data["spectrum"].sum(0) / len(data["energy"]), where="mid", label=name)
        axes[1].hist(data["hits"], bins=30, histtype="step", label=name)
        axes[2].hist(data["long_ratio"][:, 0], bins=30, histtype="step", label=f"{name} first third")
        axes[3].scatter(mc["angle"], data["angle"], s=5, label=name, alpha=0.6)
    axes[0].set(xscale="log", yscale="log", xlabel="cell energy (GeV)", ylabel="cells / event")
    axes[1].set(xlabel=f"hits (> {HIT_THRESHOLD:g} GeV)")
    axes[2].set(xlabel="energy fraction in the first third of the layers")
    axes[3].set(xlabel="MC measured angle (rad)", ylabel="measured angle (rad)")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(folder, "spectra.png"))
    fig.savefig(paths[-1], dpi=80)
    plt.close(fig)
    return paths


def validate_task(task, files, events: np.ndarray, comm, folder: Optional[str],
                  max_events: int = 512, plots: bool = True) -> dict:
    """Collective: generate one shower per MC event with the same (E, θ) and score them.

    Each rank handles a share of ``events``; rank 0 gathers the observables, scores, writes
    ``validation.json`` and the plots into ``folder``. Every rank returns the score dict.
    """
    from .data.calo import GEOMETRY

    g = GEOMETRY[task.variant]
    chosen = np.asarray(events)[:max_events]
    mine = chosen[comm.Get_rank()::comm.Get_size()]
    mc_parts, gan_parts = [], []
    for start in range(0, len(mine), 64):
        raw = files.read(mine[start:start + 64])
        raw["_index"] = mine[start:start + 64]
        batch = task.preprocess(raw)
        keep = np.isin(raw["_index"], batch["_index"])
        mc_gev = np.asarray(raw["ECAL"], dtype=np.float64)[keep] / g["unit"]
        mc_gev[mc_gev * g["unit"] < task.preprocess.threshold] = 0.0
        energy = batch["energy"] * 100.0
        generated = task.preprocess.to_gev(task.generate(batch["energy"], batch.get("angle"),
                                                         batch["_index"]))
        mc_parts.append(features(mc_gev, energy))
        gan_parts.append(features(generated, energy))
    mc_all = comm.gather(concat(mc_parts), root=0)
    gan_all = comm.gather(concat(gan_parts), root=0)
    result = None
    if comm.Get_rank() == 0:
        mc, gan = concat(mc_all), concat(gan_all)
        if not mc:
            result = {"score": None, "events": 0}
        else:
            result = score(mc, gan, with_angle=task.variant == "angle")
            if folder:
                os.makedirs(folder, exist_ok=True)
                if plots:
                    result["plots"] = plot(mc, gan, folder)
                from .io import atomic_write_text

                atomic_write_text(os.path.join(folder, "validation.json"),
                                  json.dumps(result, indent=2))
    return comm.bcast(result, root=0)
