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


def _save(fig, folder: str, name: str, title: str, what: str, rect=None) -> str:
    fig.suptitle(f"{title}: {what}" if title else what)
    fig.tight_layout(**({"rect": rect} if rect else {}))
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


def _mc_edges(mc, bins: int, floor=None):
    """Bin edges spanning the MC's central 99 % (and the floor sample's): the MC is resolved
    however far the generated values stray (those are counted on the plot)."""
    ref = np.concatenate([np.ravel(mc)] + ([] if floor is None else [np.ravel(floor)]))
    ref = ref[np.isfinite(ref)]
    lo, hi = np.percentile(ref, (0.5, 99.5)) if len(ref) else (0.0, 1.0)
    pad = 0.05 * (hi - lo) or 0.05 * abs(hi) or 0.5
    return np.linspace(lo - pad, hi + pad, bins + 1)


def _off_scale(ax, edges, values, label, y=0.02):
    values = np.ravel(values)
    off = int(((values < edges[0]) | (values > edges[-1])).sum())
    if off:
        ax.text(0.02, y, f"{off} {label} value(s) off scale, range [{np.nanmin(values):.3g}, "
                f"{np.nanmax(values):.3g}]", transform=ax.transAxes, fontsize=8)


def _hist_pair(ax, mc, gan, label, bins=30, floor=None, **kw):
    """MC and generated histograms, the floor sample filled grey; ``bins`` a count (edges from
    the MC's range, ``_mc_edges``) or explicit edges."""
    if not np.isfinite(np.ravel(mc)).any():
        return
    edges = _mc_edges(mc, bins, floor) if np.isscalar(bins) else np.asarray(bins)
    if floor is not None:
        ax.hist(np.ravel(floor), edges, histtype="stepfilled", color="0.85", label=FLOOR_LABEL)
    ax.hist(np.ravel(mc), edges, histtype="step", label="MC", **kw)
    ax.hist(np.ravel(gan), edges, histtype="step", label=label, **kw)
    _off_scale(ax, edges, gan, label)
    ax.set_ylabel("events")
    ax.legend(fontsize=LEGEND - 2)


def _legend_outside(ax):
    """The legend right of the axes, off the data."""
    ax.legend(fontsize=LEGEND, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


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
    # one legend for all panels, below them: off the data
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=LEGEND)
    fig.subplots_adjust(bottom=0.12)
    paths.append(_save(fig, folder, "profiles.png", title, "shower shapes",
                       rect=(0, 0.05, 1, 1)))

    fig, ax = plt.subplots(figsize=(10, 5))
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
    _legend_outside(ax)
    paths.append(_save(fig, folder, "sampling_fraction.png", title, "sampling fraction"))

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.5))
    centers = np.sqrt(SPECTRUM_BINS[1:] * SPECTRUM_BINS[:-1])
    for data, name in ((mc, "MC"), (gan, label)):
        axes[0].step(centers, data["spectrum"].sum(0) / len(data["energy"]), where="mid", label=name)
        axes[3].scatter(np.degrees(mc["angle"]), np.degrees(data["angle"]), s=5, label=name, alpha=0.6)
    if floor is not None:
        axes[0].step(centers, floor["spectrum"].sum(0) / len(floor["energy"]), where="mid",
                     color="0.6", label=FLOOR_LABEL)
        axes[3].scatter(np.degrees(mc["angle"]), np.degrees(floor["angle"]), s=5, color="0.6",
                        label=FLOOR_LABEL, alpha=0.6)
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

    paths.append(_reference_observables(plt, mc, gan, folder, label, title, floor))
    if "d_real" in mc:
        paths.append(_discriminator(plt, mc, gan, folder, label, title, floor))
    paths.append(_high_level(plt, mc, gan, folder, label, title, floor))
    return paths


def _reference_observables(plt, mc, gan, folder, label, title, floor=None) -> str:
    """3-D argmax, 3rd moments, sparsity, ECAL sums per energy bin, angle per angle bin; the
    floor sample (a second MC half) in grey, bins from the MC's range."""
    fig, axes = plt.subplots(3, 3, figsize=(15, 12))

    def other(key, *index):
        return None if floor is None else floor[key][(slice(None), *index)]

    for a, axis in enumerate("xyz"):
        cells = mc["max_position_3d"][:, a]   # integer bins over the MC's cells, ± 3
        lo, hi = max(cells.min() - 3, 0), min(cells.max() + 3, mc["profile_" + axis].shape[1] - 1)
        _hist_pair(axes[0, a], cells, gan["max_position_3d"][:, a], label,
                   bins=np.arange(lo, hi + 2) - 0.5, floor=other("max_position_3d", a))
        axes[0, a].set(xlabel=f"position of the maximum (3-D argmax), {axis} (cell index)")
        _hist_pair(axes[1, a], mc["index_moments"][:, a, 2], gan["index_moments"][:, a, 2], label,
                   floor=other("index_moments", a, 2))
        axes[1, a].set(xlabel=f"3rd moment along {axis} (cells³)")
    ax = axes[2, 0]
    samples = ((mc, "MC", "-o"), (gan, label, "--x"))
    if floor is not None:
        samples += ((floor, FLOOR_LABEL, ":."),)
    for data, name, style in samples:
        ax.plot(SPARSITY_EXPONENTS, data["sparsity"].mean(0), style, label=name,
                **({"color": "0.5"} if data is floor else {}))
    ax.set(yscale="log", xlabel="log10(threshold / GeV)", ylabel="fraction of cells above")
    ax.legend(fontsize=LEGEND)
    ax = axes[2, 1]
    for center in METRIC_ENERGIES[energy_set(mc["energy"])][1:]:
        sel = select(mc["energy"], center)
        if len(sel):
            # the MC's own range per bin: a far-off generator is counted, not drawn
            edges = _mc_edges(mc["sum"][sel], 20)
            line = ax.hist(mc["sum"][sel], edges, histtype="step", label=f"MC {center} GeV")[2][0]
            ax.hist(gan["sum"][sel], edges, histtype="step", ls="--", color=line.get_edgecolor(),
                    label=f"{label} {center} GeV")
            if floor is not None:
                fsel = select(floor["energy"], center)
                ax.hist(floor["sum"][fsel], edges, histtype="step", ls=":", color="0.5")
            _off_scale(ax, (edges[0], edges[-1]), gan["sum"][sel], f"{label} {center} GeV",
                       y=0.02 + 0.05 * METRIC_ENERGIES[energy_set(mc["energy"])].index(center))
    ax.set(xlabel="ECAL sum (GeV), per energy bin ±5 GeV (dotted grey: floor)", ylabel="events")
    ax.legend(fontsize=LEGEND - 1)
    ax = axes[2, 2]
    if "condition_angle" in mc:
        for degrees in ANGLE_BINS:
            sel = np.abs(mc["condition_angle"] - math.radians(degrees)) < ANGLE_TOLERANCE
            if sel.any():
                a, g = np.degrees(mc["angle"][sel]), np.degrees(gan["angle"][sel])
                edges = _mc_edges(a, 20)
                line = ax.hist(a, edges, histtype="step", label=f"MC {degrees}°")[2][0]
                ax.hist(g, edges, histtype="step", ls="--", color=line.get_edgecolor(),
                        label=f"{label} {degrees}°")
                if floor is not None:
                    fsel = np.abs(floor["condition_angle"] - math.radians(degrees)) < ANGLE_TOLERANCE
                    ax.hist(np.degrees(floor["angle"][fsel]), edges, histtype="step", ls=":",
                            color="0.5")
        ax.set(xlabel="measured angle (degrees), per angle bin ±5.7° (0.1 rad; dotted grey: "
               "floor)", ylabel="events")
        ax.legend(fontsize=LEGEND - 1)
    else:
        ax.set_axis_off()
    return _save(fig, folder, "reference_observables.png", title, "reference observables")


def _discriminator(plt, mc, gan, folder, label, title, floor=None) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    _hist_pair(axes[0], mc["d_real"], gan["d_real"], label, bins=np.linspace(0, 1, 41),
               floor=None if floor is None or "d_real" not in floor else floor["d_real"])
    axes[0].set(xlabel="discriminator P(real)")
    samples = ((mc, "MC", "o"), (gan, label, "x"))
    if floor is not None and "d_energy" in floor:
        samples += ((floor, FLOOR_LABEL, "."),)
    for data, name, marker in samples:
        rel = (data["d_energy"] - data["energy"]) / data["energy"]
        axes[1].scatter(data["energy"], rel, s=6, marker=marker, alpha=0.6, label=name,
                        **({"color": "0.5"} if data is floor else {}))
    axes[1].set(xlabel="primary energy (GeV)", ylabel="(auxiliary energy - E) / E (dimensionless)")
    _robust_limits(axes[1], (mc["d_energy"] - mc["energy"]) / mc["energy"],
                   (gan["d_energy"] - gan["energy"]) / gan["energy"])
    axes[1].legend(fontsize=LEGEND)
    return _save(fig, folder, "discriminator.png", title, "discriminator outputs")


HIGH_LEVEL_SHOWN = ("e_tot_over_e_inc", "log10_e_layer_02", "log10_e_layer_06", "log10_e_layer_12",
                    "log10_e_layer_18", "log10_e_layer_22", "centre_x", "centre_y", "width_x",
                    "width_y", "sparsity", "measured_angle")


def _high_level(plt, mc, gan, folder, label, title, floor=None) -> str:
    """The CaloChallenge's high-level features (``challenge.high_level``), each histogram's
    separation power beside the floor sample's."""
    from .challenge import high_level, separation_power

    names, x = high_level(mc)
    _, y = high_level(gan)
    z = None if floor is None else high_level(floor)[1]
    shown = [n for n in HIGH_LEVEL_SHOWN if n in names]
    fig, axes = plt.subplots(3, 4, figsize=(18, 12))
    for ax, name in zip(axes.ravel(), shown):
        i = names.index(name)
        edges = _mc_edges(x[:, i], 30, None if z is None else z[:, i])
        _hist_pair(ax, x[:, i], y[:, i], label, bins=edges, floor=None if z is None else z[:, i])
        text = f"separation {separation_power(x[:, [i]], y[:, [i]])[0]:.3f}"
        if z is not None:
            text += f", floor {separation_power(x[:, [i]], z[:, [i]])[0]:.3f}"
        unit = ("log10 GeV" if name.startswith("log10") else "cells" if name[:5] in ("centr", "width")
                else "rad" if name == "measured_angle" else "fraction of cells empty"
                if name == "sparsity" else "dimensionless")
        ax.set(xlabel=f"{name.replace('_', ' ')} ({unit})", title=text)
    for ax in axes.ravel()[len(shown):]:
        ax.set_axis_off()
    return _save(fig, folder, "high_level.png", title, "CaloChallenge high-level features")
