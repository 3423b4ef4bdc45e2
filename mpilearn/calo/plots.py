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


FLOOR_LABEL = "MC, other half (floor)"
LEGEND = 10   # legend font size, readable at the saved 80 dpi


def _hist_pair(ax, mc, gan, label, bins=30, floor=None, **kw):
    both = np.concatenate([np.ravel(mc), np.ravel(gan)])
    both = both[np.isfinite(both)]
    if not len(both):
        return
    edges = np.histogram_bin_edges(both, bins=bins)
    if floor is not None:
        ax.hist(np.ravel(floor), edges, histtype="stepfilled", color="0.85", label=FLOOR_LABEL)
    ax.hist(np.ravel(mc), edges, histtype="step", label="MC", **kw)
    ax.hist(np.ravel(gan), edges, histtype="step", label=label, **kw)
    ax.set_ylabel("events")
    ax.legend(fontsize=LEGEND)


def plot(mc: Dict[str, np.ndarray], gan: Dict[str, np.ndarray], folder: str,
         label: str = "GAN", title: str = "", floor=None) -> list:
    """PNG plots of generated vs MC; returns their paths. ``floor``: a second MC sample of the
    same size, drawn as a grey band/histogram (MC vs MC: what a perfect generator shows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    paths = []
    fig, axes = plt.subplots(2, 3, figsize=(14, 8))
    for col, axis in enumerate("xyz"):
        for row, log in enumerate((False, True)):
            ax = axes[row, col]
            if floor is not None:
                a, b = mc[f"profile_{axis}"].mean(0), floor[f"profile_{axis}"].mean(0)
                ax.fill_between(np.arange(len(a)), np.minimum(a, b), np.maximum(a, b),
                                color="0.7", label="MC vs MC band (floor)")
            for data, name, style in ((mc, "MC", "-"), (gan, label, "--")):
                prof = data[f"profile_{axis}"].mean(0)
                ax.plot(np.arange(len(prof)), prof, style, label=name)
            ax.set_xlabel(f"{axis} (cell index)" if axis != "z" else "z (layer index)")
            ax.set_ylabel("mean energy per event (GeV)")
            if log:
                ax.set_yscale("log")
            ax.legend(fontsize=LEGEND)
    paths.append(_save(fig, folder, "profiles.png", title, "shower shapes"))

    fig, ax = plt.subplots(figsize=(7, 5))
    edges = np.linspace(mc["energy"].min(), mc["energy"].max() + 1e-9, 11)
    # a log axis: the MC's ~0.02 and an early generator's 2-5 both stay readable
    samples = ((mc, "MC", "o", "-"), (gan, label, "x", "--"))
    if floor is not None:
        samples += ((floor, FLOOR_LABEL, ".", ":"),)
    for data, name, marker, style in samples:
        ax.scatter(data["energy"], data["sampling_fraction"], s=6, marker=marker, label=name, alpha=0.5)
        idx = np.digitize(data["energy"], edges) - 1
        means = [data["sampling_fraction"][idx == i].mean() if (idx == i).any() else np.nan
                 for i in range(10)]
        ax.plot(0.5 * (edges[1:] + edges[:-1]), means, style, lw=2, label=f"{name}, bin mean")
    ax.set_xlabel("primary energy (GeV)")
    ax.set_ylabel("sampling fraction (ECAL sum / primary energy)")
    values = np.concatenate([mc["sampling_fraction"], gan["sampling_fraction"]])
    if (values > 0).any():
        ax.set_yscale("log")
    ax.legend(fontsize=LEGEND)
    paths.append(_save(fig, folder, "sampling_fraction.png", title, "sampling fraction"))

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.5))
    centers = np.sqrt(SPECTRUM_BINS[1:] * SPECTRUM_BINS[:-1])
    for data, name in ((mc, "MC"), (gan, label)):
        axes[0].step(centers, data["spectrum"].sum(0) / len(data["energy"]), where="mid", label=name)
        axes[3].scatter(np.degrees(mc["angle"]), np.degrees(data["angle"]), s=5, label=name, alpha=0.6)
    if floor is not None:
        axes[0].step(centers, floor["spectrum"].sum(0) / len(floor["energy"]), where="mid",
                     color="0.6", label=FLOOR_LABEL)
    _hist_pair(axes[1], mc["hits"], gan["hits"], label,
               floor=None if floor is None else floor["hits"])
    _hist_pair(axes[2], mc["long_ratio"][:, 0], gan["long_ratio"][:, 0], label,
               floor=None if floor is None else floor["long_ratio"][:, 0])
    axes[0].set(xscale="log", yscale="log", xlabel="cell energy (GeV)", ylabel="cells per event")
    axes[1].set(xlabel=f"hits: cells above {HIT_THRESHOLD:g} GeV (count)")
    axes[2].set(xlabel="energy fraction in the first third of the layers (dimensionless)")
    axes[3].set(xlabel="MC measured angle (degrees)", ylabel="measured angle (degrees)")
    axes[0].legend(fontsize=LEGEND), axes[3].legend(fontsize=LEGEND)
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
        axes[0, a].set(xlabel=f"position of the maximum (3-D argmax), {axis} (cell index)")
        _hist_pair(axes[1, a], mc["index_moments"][:, a, 2], gan["index_moments"][:, a, 2], label)
        axes[1, a].set(xlabel=f"3rd moment along {axis} (cells³)")
    ax = axes[2, 0]
    for data, name, style in ((mc, "MC", "-o"), (gan, label, "--x")):
        ax.plot(SPARSITY_EXPONENTS, data["sparsity"].mean(0), style, label=name)
    ax.set(yscale="log", xlabel="log10(threshold / GeV)", ylabel="fraction of cells above")
    ax.legend(fontsize=LEGEND)
    ax = axes[2, 1]
    for center in METRIC_ENERGIES[energy_set(mc["energy"])][1:]:
        sel = select(mc["energy"], center)
        if len(sel):
            edges = np.histogram_bin_edges(np.concatenate([mc["sum"][sel], gan["sum"][sel]]), 20)
            line = ax.hist(mc["sum"][sel], edges, histtype="step", label=f"MC {center} GeV")[2][0]
            ax.hist(gan["sum"][sel], edges, histtype="step", ls="--", color=line.get_edgecolor(),
                    label=f"{label} {center} GeV")
    ax.set(xlabel="ECAL sum (GeV), per energy bin ±5 GeV", ylabel="events")
    ax.legend(fontsize=LEGEND - 1)
    ax = axes[2, 2]
    if "condition_angle" in mc:
        for degrees in ANGLE_BINS:
            sel = np.abs(mc["condition_angle"] - math.radians(degrees)) < ANGLE_TOLERANCE
            if sel.any():
                a, g = np.degrees(mc["angle"][sel]), np.degrees(gan["angle"][sel])
                edges = np.histogram_bin_edges(np.concatenate([a, g]), 20)
                line = ax.hist(a, edges, histtype="step", label=f"MC {degrees}°")[2][0]
                ax.hist(g, edges, histtype="step", ls="--", color=line.get_edgecolor(),
                        label=f"{label} {degrees}°")
        ax.set(xlabel="measured angle (degrees), per angle bin ±5.7° (0.1 rad)", ylabel="events")
        ax.legend(fontsize=LEGEND - 1)
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
    axes[1].set(xlabel="primary energy (GeV)", ylabel="(auxiliary energy - E) / E (dimensionless)")
    _robust_limits(axes[1], (mc["d_energy"] - mc["energy"]) / mc["energy"],
                   (gan["d_energy"] - gan["energy"]) / gan["energy"])
    axes[1].legend(fontsize=LEGEND)
    return _save(fig, folder, "discriminator.png", title, "discriminator outputs")
