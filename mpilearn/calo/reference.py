"""The reference 3DGAN analysis's own single numbers (reference 3dgan.md §4d), beside mpilearn's
score, computed exactly as the reference code does so that the numbers compare with published
ones:

reference_metric  ``GANutils.metric`` as ``OptAnalysisAngle`` calls it in training, on the
    reference's event selection: energy bins of ±5 GeV (open interval) around (0, 110, 150,
    190) GeV for a 100-200 GeV sample, else (0, 50, 100, 200, 250, 300, 400, 500) GeV; bin "0"
    is the first 5 000 events in file order. Per bin:
      moments  = Σ over the m = 2 moments of (|δx| + |δy| + |δz|) / 3, / m, where δ is the
                 relative error (MC - GAN) / MC of the bin-mean moment; moments in cell-index
                 units (no +0.5), the 2nd central about the 1st; **added twice per bin**, as
                 the reference's duplicated block does;
      profiles = mean over axes of Σ_i |(P_i,MC - P_i,GAN) / P_i,MC| / n_cells of the bin-mean
                 x, y, z profiles, cell by cell: a cell with no MC energy on average makes it
                 infinite, as there, unless the GAN's is empty too (then it counts 0 where the
                 reference's 0/0 gives NaN: two identical samples score 0);
      angle    = mean over events of |(θ - θ_GAN,meas) / θ| with θ the conditioning angle.
    Each term is averaged over the bins; total = moments + profiles (+ angle).
sampling_fraction_mre  ``SelectEpoch.py``'s "mre": over the bins (110, 150, 190) GeV (100-200
    GeV samples) or (100, 200, 300, 400) GeV, the mean of |<SF>_MC - <SF>_GAN| / <SF>_MC, with
    its error bar sqrt(mean over bins of var(SF_GAN)/N + (std(SF_MC)/<SF>_GAN)²/N).

reference_metric_filled  the same, finite wherever the sample allows: each profile term is the
    mean over the cells the MC fills in that bin (``reference_filled_skipped_cells`` counts the
    cells left out, summed over bins and axes), and the bin-mean moments and the angle term skip
    generated showers with no energy (``reference_filled_skipped_events``). Where no cell is
    empty and no shower is empty it equals ``reference_metric``.

Two changes, both only where the reference produces NaN: a bin with no MC event is left out
(the averages run over the bins kept), and a profile cell empty in both samples counts 0.
``reference_empty_mc_cells`` counts the cells that make the profile term infinite (small
validation samples have them; the reference ran on thousands of events per bin), and
``reference_empty_gan_events`` the generated showers with no energy, whose moments, and so the
moment term, are NaN there and here.
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np

REDUCED_RANGE = (100.0, 200.0)
METRIC_ENERGIES = {"reduced": (0, 110, 150, 190), "full": (0, 50, 100, 200, 250, 300, 400, 500)}
SF_ENERGIES = {"reduced": (110, 150, 190), "full": (100, 200, 300, 400)}
TOLERANCE = 5.0     # GeV either side of a bin's energy
ALL_EVENTS = 5000   # bin "0": the first this many events
# the per-event observables' binning, as the reference's plots (physics.features computes
# them, plots.py draws them)
HIT_THRESHOLD = 3e-4             # GeV
SPECTRUM_BINS = np.logspace(-12, 1, 101)   # GeV
SPARSITY_EXPONENTS = np.arange(-13, 1)     # fraction of cells above 10^k GeV
MOMENTS = 2


def energy_set(energy: np.ndarray) -> str:
    lo, hi = REDUCED_RANGE
    return "reduced" if len(energy) and energy.min() >= lo and energy.max() <= hi else "full"


def select(energy: np.ndarray, center: float) -> np.ndarray:
    """Indices of the events in the reference's bin ``center`` (0: the first 5 000)."""
    if center == 0:
        return np.arange(min(len(energy), ALL_EVENTS))
    return np.nonzero((energy > center - TOLERANCE) & (energy < center + TOLERANCE))[0]


def index_moments(profiles, m: int = 3) -> np.ndarray:
    """(N, 3 axes, m) moments of the x, y, z profiles as the reference's get_moments: the
    barycentre in cell-index units, then central moments of order 2..m about it."""
    out = []
    for prof in profiles:
        prof = np.asarray(prof, dtype=np.float64)
        idx = np.arange(prof.shape[1], dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            total = prof.sum(1)
            mid = (prof * idx).sum(1) / total
            orders = [mid] + [(prof * (idx[None, :] - mid[:, None]) ** k).sum(1) / total
                              for k in range(2, m + 1)]
        out.append(np.stack(orders, 1))
    return np.stack(out, 1)


def reference_metric(mc: Dict[str, np.ndarray], gan: Dict[str, np.ndarray],
                     with_angle: bool = True) -> dict:
    """The reference's optimisation metric and its terms (paired samples, see module doc)."""
    if with_angle and "condition_angle" not in mc:
        raise ValueError("the reference metric's angle term needs the MC events' "
                         "conditioning angle (features(..., condition_angle=...))")
    energies = METRIC_ENERGIES[energy_set(mc["energy"])]
    terms: Dict[str, List[float]] = {"moments": [], "profiles": [], "angle": []}
    filled: Dict[str, List[float]] = {"moments": [], "profiles": [], "angle": []}
    used, empty_cells, empty_both = [], 0, 0
    with np.errstate(divide="ignore", invalid="ignore"):
        for center in energies:
            sel = select(mc["energy"], center)
            if not len(sel):
                continue
            used.append(center)
            act = mc["index_moments"][sel][:, :, :MOMENTS].mean(0)   # (axes, m)
            fake = gan["index_moments"][sel][:, :, :MOMENTS].mean(0)
            per_moment = np.abs((act - fake) / act).sum(0) / 3      # mean over axes
            terms["moments"].append(2 * per_moment.sum() / MOMENTS)  # the block runs twice
            # filled: the bin means over the showers with energy (an empty one has no moments)
            act_f = np.nanmean(mc["index_moments"][sel][:, :, :MOMENTS], 0)
            fake_f = np.nanmean(gan["index_moments"][sel][:, :, :MOMENTS], 0)
            filled["moments"].append(2 * (np.abs((act_f - fake_f) / act_f).sum(0) / 3).sum() / MOMENTS)
            prof, prof_f = [], []
            for ax in "xyz":
                a, b = mc[f"profile_{ax}"][sel].mean(0), gan[f"profile_{ax}"][sel].mean(0)
                rel = np.where((a == 0) & (b == 0), 0.0, np.abs((a - b) / a))
                empty_cells += int(((a == 0) & (b != 0)).sum())
                empty_both += int(((a == 0) & (b == 0)).sum())
                prof.append(rel.sum() / len(a))
                # filled: the mean over the cells the MC fills
                prof_f.append(rel[a > 0].mean() if (a > 0).any() else np.nan)
            terms["profiles"].append(sum(prof) / 3)
            filled["profiles"].append(sum(prof_f) / 3)
            if with_angle:
                theta = mc["condition_angle"][sel]
                rel = np.abs((theta - gan["angle"][sel]) / theta)
                terms["angle"].append(np.mean(rel))
                filled["angle"].append(np.nanmean(rel) if np.isfinite(rel).any() else np.nan)
    out = {f"reference_{k}": float(np.mean(v)) for k, v in terms.items() if v}
    out["reference_metric"] = float(sum(out.values())) if out else float("nan")
    parts = {f"reference_filled_{k}": float(np.mean(v)) for k, v in filled.items() if v}
    out.update(parts)
    out["reference_metric_filled"] = float(sum(parts.values())) if parts else float("nan")
    out["reference_bins"] = used
    out["reference_empty_mc_cells"] = empty_cells  # each makes the profile term infinite
    out["reference_empty_gan_events"] = int((gan["sum"] == 0).sum())  # each: NaN moments
    # what the filled variant leaves out: the cells the MC leaves empty in a bin (these, and
    # the ones empty in both), and the generated showers with no energy
    out["reference_filled_skipped_cells"] = empty_cells + empty_both
    out["reference_filled_skipped_events"] = out["reference_empty_gan_events"]
    return out


def sampling_fraction_mre(mc: Dict[str, np.ndarray], gan: Dict[str, np.ndarray]) -> dict:
    """SelectEpoch.py's "mre" with its error bar, and the value per energy bin."""
    out, errors, variances = {}, [], []
    for center in SF_ENERGIES[energy_set(mc["energy"])]:
        sel = select(mc["energy"], center)
        if not len(sel):
            continue
        act, fake = mc["sampling_fraction"][sel], gan["sampling_fraction"][sel]
        n = len(sel)
        err = abs(act.mean() - fake.mean()) / act.mean()
        out[f"sampling_fraction_mre_{center}"] = float(err)
        errors.append(err)
        variances.append(fake.std() ** 2 / n + (act.std() / fake.mean()) ** 2 / n)
    out["sampling_fraction_mre"] = float(np.mean(errors)) if errors else float("nan")
    out["sampling_fraction_mre_error"] = (float(np.sqrt(np.mean(variances))) if variances
                                          else float("nan"))
    return out
