"""Validation plots of generated vs MC showers (the reference's observables, 3dgan.md §4b).

Every figure's title names the run and epoch it shows; axes follow the data, and a plot whose
axis is clipped says how many values lie off it.
"""
from __future__ import annotations

import math
import os
from typing import Dict

import numpy as np

from .reference import (HIT_THRESHOLD, METRIC_ENERGIES, SPARSITY_EXPONENTS, SPECTRUM_BINS,
                        energy_set, select)

ANGLE_BINS = (62, 90, 118)   # degrees, ± 0.1 rad: the reference's angle bins
ANGLE_TOLERANCE = 0.1


def _save(fig, folder: str, name: str, title: str, what: str) -> str:
    fig.suptitle(f"{title}: {what}" if title else what)
    fig.tight_layout()
    path = os.path.join(folder, name)
    fig.savefig(path, dpi=80)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _robust_limits(ax, *samples, coverage=(0.5, 99.5)):
    """y limits holding the central 99 % of the values; the rest is counted on the plot."""
    values = np.concatenate([np.asarray(s, dtype=np.float64).ravel() for s in samples])
    values = values[np.isfinite(values)]
    if not len(values):
        return
    lo, hi = np.percentile(values, coverage)
    pad = 0.1 * (hi - lo) or 0.1 * abs(hi) or 1e-3
    lo, hi = lo - pad, hi + pad
    ax.set_ylim(lo, hi)
    off = (values < lo) | (values > hi)
    if off.any():
        ax.text(0.02, 0.02, f"{int(off.sum())} value(s) off scale, range "
                f"[{values.min():.3g}, {values.max():.3g}]", transform=ax.transAxes, fontsize=8)


def _hist_pair(ax, mc, gan, label, bins=30, **kw):
    both = np.concatenate([np.ravel(mc), np.ravel(gan)])
    both = both[np.isfinite(both)]
    if not len(both):
        return
    edges = np.histogram_bin_edges(both, bins=bins)
    ax.hist(np.ravel(mc), edges, histtype="step", label="MC", **kw)
    ax.hist(np.ravel(gan), edges, histtype="step", label=label, **kw)
    ax.legend(fontsize=8)


def plot(mc: Dict[str, np.ndarray], gan: Dict[str, np.ndarray], folder: str,
         label: str = "GAN", title: str = "") -> list:
    """PNG plots of generated vs MC; returns their paths."""
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
    paths.append(_save(fig, folder, "profiles.png", title, "shower shapes"))

    fig, ax = plt.subplots(figsize=(7, 5))
    edges = np.linspace(mc["energy"].min(), mc["energy"].max() + 1e-9, 11)
    for data, name, marker in ((mc, "MC", "o"), (gan, label, "x")):
        ax.scatter(data["energy"], data["sampling_fraction"], s=6, marker=marker, label=name, alpha=0.6)
        idx = np.digitize(data["energy"], edges) - 1
        means = [data["sampling_fraction"][idx == i].mean() if (idx == i).any() else np.nan
                 for i in range(10)]
        ax.plot(0.5 * (edges[1:] + edges[:-1]), means, "-" if name == "MC" else "--", lw=2)
    ax.set_xlabel("primary energy (GeV)")
    ax.set_ylabel("sampling fraction")
    _robust_limits(ax, mc["sampling_fraction"], gan["sampling_fraction"])
    ax.legend()
    paths.append(_save(fig, folder, "sampling_fraction.png", title, "sampling fraction"))

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.5))
    centers = np.sqrt(SPECTRUM_BINS[1:] * SPECTRUM_BINS[:-1])
    for data, name in ((mc, "MC"), (gan, label)):
        axes[0].step(centers, data["spectrum"].sum(0) / len(data["energy"]), where="mid", label=name)
        axes[3].scatter(mc["angle"], data["angle"], s=5, label=name, alpha=0.6)
    _hist_pair(axes[1], mc["hits"], gan["hits"], label)
    _hist_pair(axes[2], mc["long_ratio"][:, 0], gan["long_ratio"][:, 0], label)
    axes[0].set(xscale="log", yscale="log", xlabel="cell energy (GeV)", ylabel="cells / event")
    axes[1].set(xlabel=f"hits (> {HIT_THRESHOLD:g} GeV)")
    axes[2].set(xlabel="energy fraction in the first third of the layers")
    axes[3].set(xlabel="MC measured angle (rad)", ylabel="measured angle (rad)")
    axes[0].legend(), axes[3].legend()
    paths.append(_save(fig, folder, "spectra.png", title, "cell spectrum, hits, ratios, angle"))

    paths.append(_reference_observables(plt, mc, gan, folder, label, title))
    if "d_real" in mc:
        paths.append(_discriminator(plt, mc, gan, folder, label, title))
    return paths


def _reference_observables(plt, mc, gan, folder, label, title) -> str:
    """3-D argmax, 3rd moments, sparsity, ECAL sums per energy bin, angle per angle bin."""
    fig, axes = plt.subplots(3, 3, figsize=(15, 12))
    for a, axis in enumerate("xyz"):
        _hist_pair(axes[0, a], mc["max_position_3d"][:, a], gan["max_position_3d"][:, a], label,
                   bins=np.arange(mc["profile_" + axis].shape[1] + 1) - 0.5)
        axes[0, a].set(xlabel=f"position of the maximum (3-D argmax), {axis} cell")
        _hist_pair(axes[1, a], mc["index_moments"][:, a, 2], gan["index_moments"][:, a, 2], label)
        axes[1, a].set(xlabel=f"3rd moment along {axis} (cells³)")
    ax = axes[2, 0]
    for data, name, style in ((mc, "MC", "-o"), (gan, label, "--x")):
        ax.plot(SPARSITY_EXPONENTS, data["sparsity"].mean(0), style, label=name)
    ax.set(yscale="log", xlabel="log10(threshold / GeV)", ylabel="fraction of cells above")
    ax.legend(fontsize=8)
    ax = axes[2, 1]
    for center in METRIC_ENERGIES[energy_set(mc["energy"])][1:]:
        sel = select(mc["energy"], center)
        if len(sel):
            edges = np.histogram_bin_edges(np.concatenate([mc["sum"][sel], gan["sum"][sel]]), 20)
            line = ax.hist(mc["sum"][sel], edges, histtype="step", label=f"MC {center} GeV")[2][0]
            ax.hist(gan["sum"][sel], edges, histtype="step", ls="--", color=line.get_edgecolor(),
                    label=f"{label} {center} GeV")
    ax.set(xlabel="ECAL sum (GeV), per energy bin ±5 GeV")
    ax.legend(fontsize=7)
    ax = axes[2, 2]
    if "condition_angle" in mc:
        for degrees in ANGLE_BINS:
            sel = np.abs(mc["condition_angle"] - math.radians(degrees)) < ANGLE_TOLERANCE
            if sel.any():
                edges = np.histogram_bin_edges(np.concatenate([mc["angle"][sel], gan["angle"][sel]]), 20)
                line = ax.hist(mc["angle"][sel], edges, histtype="step", label=f"MC {degrees}°")[2][0]
                ax.hist(gan["angle"][sel], edges, histtype="step", ls="--",
                        color=line.get_edgecolor(), label=f"{label} {degrees}°")
        ax.set(xlabel="measured angle (rad), per angle bin ±0.1 rad")
        ax.legend(fontsize=7)
    else:
        ax.set_axis_off()
    return _save(fig, folder, "reference_observables.png", title, "reference observables")


def _discriminator(plt, mc, gan, folder, label, title) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    _hist_pair(axes[0], mc["d_real"], gan["d_real"], label, bins=np.linspace(0, 1, 41))
    axes[0].set(xlabel="discriminator P(real)")
    for data, name, marker in ((mc, "MC", "o"), (gan, label, "x")):
        rel = (data["d_energy"] - data["energy"]) / data["energy"]
        axes[1].scatter(data["energy"], rel, s=6, marker=marker, alpha=0.6, label=name)
    axes[1].set(xlabel="primary energy (GeV)", ylabel="(auxiliary energy - E) / E")
    _robust_limits(axes[1], (mc["d_energy"] - mc["energy"]) / mc["energy"],
                   (gan["d_energy"] - gan["energy"]) / gan["energy"])
    axes[1].legend(fontsize=8)
    return _save(fig, folder, "discriminator.png", title, "discriminator outputs")
