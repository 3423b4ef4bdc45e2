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

Each headline number has its MC-vs-MC floor beside it (``FLOORED``): the same metric between
two disjoint MC halves of the same size, paired by their conditions (``pair_by_conditions``),
as ``<name>_floor``, and ``<name>_ratio`` = number / floor, where 1 is as good as the MC itself.
The generator is scored on the first half, so both numbers come from samples of one size.
FPD and KPD (``SIGMA``) have a floor of 0 within its error: no ratio to it is taken, and
``<name>_sigma`` is the distance from the floor in standard deviations,
(number - floor) / sqrt(error^2 + floor_error^2), printed with the floor and its error
(``fpd 83.45 (3 700 σ; MC floor 0.0000 ± 0.022)``).

Beside it, ``mpilearn.calo.reference`` computes the reference analysis's own metric and
sampling-fraction MRE on the reference's event selection, exactly as its code does.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Optional

import numpy as np

from .format import measured_angle_np
from .reference import (HIT_THRESHOLD, SPARSITY_EXPONENTS, SPECTRUM_BINS, index_moments,
                        reference_metric, sampling_fraction_mre)

ENERGY_BINS = 4
# the numbers reported beside their MC-vs-MC floor, under these names everywhere (validate's
# JSON, the epoch records, monitors and HPO objectives), with _floor, _error and _ratio (or
# _sigma)
FLOORED = ("score", "reference_metric_filled", "sampling_fraction_mre", "fpd", "kpd",
           "separation_power", "auc_high")
# the distances whose MC-vs-MC floor is 0 within its error (KPD's can be below 0): a ratio to
# that floor means nothing, so they are reported as a distance from it in standard deviations,
# ``<name>_sigma`` = (value - floor) / sqrt(error^2 + floor_error^2), beside the floor and its
# error (``<name>_floor_error``); the others as ``<name>_ratio`` = value / floor ("x floor")
SIGMA = ("fpd", "kpd")


def beside_floor(name: str) -> str:
    """The suffix of ``name``'s comparison with its floor: ``_sigma`` or ``_ratio``."""
    return "_sigma" if name in SIGMA else "_ratio"


def features(images_gev: np.ndarray, energy_gev: np.ndarray, condition_angle=None,
             index=None, discriminator=None) -> Dict[str, np.ndarray]:
    """Per-event observables of (N, X, Y, Z) cell energies in GeV; ``condition_angle`` is the
    angle the shower was made for, ``index`` its event number (the reference's bin "0" takes
    the first events in file order), ``discriminator`` per-event D outputs to carry along."""
    img = np.asarray(images_gev, dtype=np.float64)
    n = len(img)
    cells = int(np.prod(img.shape[1:]))  # not -1: numpy cannot infer it for 0 events
    total = img.reshape(n, cells).sum(1)
    safe = np.where(total > 0, total, 1.0)
    profiles = [img.sum(axis=(2, 3)), img.sum(axis=(1, 3)), img.sum(axis=(1, 2))]
    moments = np.zeros((n, 3, 2))
    for a, prof in enumerate(profiles):
        pos = np.arange(prof.shape[1]) + 0.5
        m1 = (prof * pos).sum(1) / safe
        m2 = (prof * (pos[None, :] - m1[:, None]) ** 2).sum(1) / safe
        moments[:, a] = np.stack([m1, m2], 1)
    nz = img.shape[3]
    third = nz // 3  # 8/8/9 layers for 25, as the reference
    thirds = [np.arange(0, third), np.arange(third, 2 * third), np.arange(2 * third, nz)]
    flat = img.reshape(n, cells)
    out = {
        "energy": np.asarray(energy_gev, dtype=np.float64),
        "sum": total,
        "sampling_fraction": total / np.asarray(energy_gev, dtype=np.float64),
        "profile_x": profiles[0], "profile_y": profiles[1], "profile_z": profiles[2],
        "moments": moments,
        "max_position": np.stack([p.argmax(1) for p in profiles], 1),
        "hits": (img > HIT_THRESHOLD).reshape(n, cells).sum(1),
        "long_ratio": np.stack([profiles[2][:, t].sum(1) for t in thirds], 1) / safe[:, None],
        "angle": measured_angle_np(img),
        "spectrum": np.stack([np.histogram(e[e > 0], SPECTRUM_BINS)[0] for e in flat])
        if n else np.zeros((0, len(SPECTRUM_BINS) - 1), np.int64),
        "index_moments": index_moments(profiles, 3),
        "max_position_3d": np.stack(np.unravel_index(flat.argmax(1), img.shape[1:]), 1)
        if n else np.zeros((0, 3), np.int64),
        "sparsity": np.stack([(flat > 10.0 ** k).mean(1) for k in SPARSITY_EXPONENTS], 1),
        "index": np.arange(n) if index is None else np.asarray(index),
    }
    if condition_angle is not None:
        out["condition_angle"] = np.asarray(condition_angle, dtype=np.float64).reshape(-1)
    for name, values in (discriminator or {}).items():
        out[f"d_{name}"] = np.asarray(values, dtype=np.float64).reshape(n, -1)[:, 0]
    return out


def concat(parts) -> Dict[str, np.ndarray]:
    """One sample from per-chunk (or per-rank) parts, in event order."""
    parts = [p for p in parts if p and len(p["energy"])]
    if not parts:
        return {}
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.argsort(out["index"], kind="stable")
    return {k: v[order] for k, v in out.items()}


def energy_bins(energy: np.ndarray, n_bins: int = ENERGY_BINS, min_events: int = 10):
    """Masks of equal-width energy bins holding at least ``min_events`` MC events."""
    edges = np.linspace(energy.min(), energy.max() + 1e-9, n_bins + 1)
    masks = [(energy >= lo) & (energy < hi) for lo, hi in zip(edges[:-1], edges[1:])]
    masks = [m for m in masks if m.sum() >= min_events]
    return masks or [np.ones_like(energy, dtype=bool)]


def _rel(a, b):
    return np.abs(a - b) / np.maximum(np.abs(a), 1e-12)


def score(mc: Dict[str, np.ndarray], gan: Dict[str, np.ndarray], with_angle: bool = True,
          classifier: bool = False, seeds: int = 5) -> dict:
    """The single-number score and its three terms, the reference's numbers and the
    CaloChallenge's (``challenge.metrics``; the classifier AUC with ``classifier``, over
    ``seeds`` seeds); mc and gan are paired event by event."""
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
    out.update(reference_metric(mc, gan, with_angle))
    out.update(sampling_fraction_mre(mc, gan))
    from .challenge import metrics

    out.update(metrics(mc, gan, classifier, seeds))
    out["events"] = int(len(mc["energy"]))
    return out


def halves(events: np.ndarray, max_events: int):
    """Two disjoint halves of the same size, at most ``max_events`` each: the generator is
    scored on the first, the floor is the first against the second (none for one event)."""
    events = np.asarray(events)
    n = min(max_events, len(events) // 2)
    if n == 0:
        return events[:max_events], events[:0]
    return events[:n], events[n:2 * n]


def _paired_order(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]):
    """Indices (ia, ib) of equal length pairing ``a``'s events with ``b``'s of nearly the same
    (E, θ), in ``a``'s event order: both sorted by energy into ENERGY_BINS blocks, by angle
    within a block."""
    n = min(len(a["energy"]), len(b["energy"]))

    def order(s):
        by_energy = np.argsort(s["energy"], kind="stable")
        by_energy = by_energy[np.linspace(0, len(by_energy) - 1, n).round().astype(int)]
        angle = s.get("condition_angle", np.zeros(len(s["energy"])))[by_energy]
        block = np.arange(n) * ENERGY_BINS // n
        return by_energy[np.lexsort((angle, block))]

    oa, ob = order(a), order(b)
    keep = np.argsort(a["index"][oa], kind="stable")
    return oa[keep], ob[keep]


def condition_mismatch(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]) -> dict:
    """Whether two samples were drawn for the same conditions: the two-sample
    Kolmogorov-Smirnov p-value of their primary energies, and of their angles."""
    from scipy.stats import ks_2samp

    out = {"energy_ks_pvalue": float(ks_2samp(a["energy"], b["energy"]).pvalue)}
    if "condition_angle" in a and "condition_angle" in b:
        out["angle_ks_pvalue"] = float(ks_2samp(a["condition_angle"], b["condition_angle"]).pvalue)
    return out


def pair_by_conditions(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]):
    """Two samples cut to one size, reordered so that event i of each has nearly the same
    (E, θ) (``_paired_order``), and ``b`` moved to ``a``'s conditions to first order; the
    pairs keep ``a``'s event order (the reference's bin "0" takes the first events).

    Two independent samples still differ by a few degrees pair by pair, which the per-event
    angle terms would count, so ``b``'s measured angle is shifted by the difference in
    conditioning angle, and its energies (profiles, sum, layers) scaled by the ratio of
    primary energies."""
    ia, ib = _paired_order(a, b)
    first = {k: v[ia] for k, v in a.items()}
    second = {k: v[ib] for k, v in b.items()}
    scale = first["energy"] / second["energy"]
    for key in ("sum", "profile_x", "profile_y", "profile_z"):
        second[key] = second[key] * scale.reshape(-1, *[1] * (second[key].ndim - 1))
    second["energy"] = first["energy"]
    if "condition_angle" in first and "condition_angle" in second:
        second["angle"] = second["angle"] + first["condition_angle"] - second["condition_angle"]
        second["condition_angle"] = first["condition_angle"]
    return first, second


def floor_ratio(name: str, result: dict, floor: dict) -> Optional[float]:
    """``result[name]`` over ``floor[name]``, for a floor that is a number (not ``SIGMA``'s)."""
    value, base = result.get(name), floor.get(name)
    ok = (name not in SIGMA and value is not None and base is not None and np.isfinite(base)
          and base > 0)
    return float(value / base) if ok else None


def floor_sigma(name: str, result: dict, floor: dict) -> Optional[float]:
    """(value - floor) / sqrt(error^2 + floor_error^2): how many standard deviations
    ``result[name]`` lies above its MC-vs-MC floor (below 0: under it); None without a value,
    a floor or an error."""
    value, base = result.get(name), floor.get(name)
    errors = [result.get(f"{name}_error"), floor.get(f"{name}_error")]
    if value is None or base is None or any(e is None or not np.isfinite(e) for e in errors):
        return None
    scale = float(np.hypot(*errors))
    if scale > 0:
        return float((value - base) / scale)
    return 0.0 if value == base else None


def with_floor(result: dict, mc: Dict[str, np.ndarray], mc_other: Dict[str, np.ndarray],
               with_angle: bool = True, classifier: bool = False, seeds: int = 5):
    """``result`` (``score(mc, gan)``) with each ``FLOORED`` number's ``_floor`` (``mc``
    against the disjoint ``mc_other``) and ``_ratio`` (``SIGMA``'s: ``_floor_error`` and
    ``_sigma``); returns (result, the second half's features paired with ``mc``, or None)."""
    if not mc_other or not len(mc_other.get("energy", ())):
        result.update({f"{k}{s}": None for k in FLOORED for s in ("_floor", beside_floor(k))})
        return result, None
    first, second = pair_by_conditions(mc, mc_other)
    floor = score(first, second, with_angle, classifier, seeds)
    for name in FLOORED:
        result[f"{name}_floor"] = floor.get(name)
        if name in SIGMA or name == "auc_high":
            result[f"{name}_floor_error"] = floor.get(f"{name}_error")
        if name in SIGMA:
            result[f"{name}_sigma"] = floor_sigma(name, result, floor)
        else:
            result[f"{name}_ratio"] = floor_ratio(name, result, floor)
    if "separation_power_features" in floor:   # each feature's value beside its floor
        result["separation_power_features"] = {
            k: {"value": v, "floor": floor["separation_power_features"][k]}
            for k, v in result.get("separation_power_features", {}).items()}
    result["floor_events"] = floor["events"]
    return result, second


def _cells_gev(task, raw: dict, index: np.ndarray) -> np.ndarray:
    """Raw file events ``index`` as thresholded cell energies in GeV."""
    from .format import GEOMETRY

    unit = GEOMETRY[task.variant]["unit"]
    cells = np.asarray(raw["ECAL"], dtype=np.float64)[np.isin(raw["_index"], index)] / unit
    cells[cells * unit < task.preprocess.threshold] = 0.0
    return cells


def _observe(task, batch: dict, cells_gev: np.ndarray) -> Dict[str, np.ndarray]:
    d = task.discriminate(batch["images"]) if hasattr(task, "discriminate") and len(cells_gev) else None
    return features(cells_gev, batch["energy"] * 100.0, batch.get("angle"), batch["_index"], d)


# a --generated sample whose conditions (energy or angle) a KS test tells from the MC's at
# this p-value is refused: it was made for other conditions, and pairing would compare unlike
# showers (two samples of one distribution are refused once in a thousand)
MIN_CONDITION_PVALUE = 1e-3


def _refuse_mismatch(mismatch: dict, gan) -> None:
    from ..errors import UsageError

    if not gan:
        raise UsageError("--generated: no generated shower passed the selection")
    bad = {k.split("_")[0]: v for k, v in mismatch.items() if v < MIN_CONDITION_PVALUE}
    if bad:
        raise UsageError(
            "--generated: its showers were made for other conditions than the MC's: their "
            + " and ".join(f"{k} distribution differs (KS p-value {v:.2g} < "
                           f"{MIN_CONDITION_PVALUE:g})" for k, v in bad.items())
            + "; compare showers generated for the MC's energies and angles: python -m "
            "mpilearn.generate --conditions MC.h5 (the --mc files) makes one per MC event")


def validate_task(task, files, events: np.ndarray, comm, folder: Optional[str],
                  max_events: int = 512, plots: bool = True, generated=None,
                  title: str = "", classifier: bool = False, seeds: int = 5,
                  voxel_events: int = 0, device: str = "cpu") -> dict:
    """Collective: one shower per MC event with the same (E, θ), scored against the MC.

    ``events`` are split into two disjoint halves of at most ``max_events`` each
    (``halves``): showers are made for the first and scored against it, and the first
    against the second is the MC-vs-MC floor (``with_floor``). The showers come from
    ``task.generate``, or, with ``generated`` (files in the MC's format, each shower carrying
    its own conditioning), are read from the same event numbers there and paired with the MC
    by their conditions, as the floor's second half is (``pair_by_conditions``); a sample made
    for other conditions is refused (UsageError). ``classifier``: the high-level classifier
    AUC too (``seeds`` runs, for the number and its floor); ``voxel_events``: the low-level
    (voxel) classifier AUC too, on the first that many events of the MC, the generated showers
    and the floor's MC half (``challenge.voxel_auc``, on ``device``; no pairing: the classifier
    compares distributions, with E_inc among its inputs). Each rank handles a share of
    ``events``; rank 0 gathers the observables, scores, writes ``validation.json`` and the
    plots (titled ``title``) into ``folder``. Every rank returns the result dict.
    """
    chosen, other = halves(events, max_events)
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = chosen[rank::size]
    mc_parts, gan_parts, other_parts = [], [], []
    # the voxel classifier's subsample: each rank keeps its share's first cells
    per_rank = -(-voxel_events // size) if voxel_events else 0
    voxels = {"mc": [], "gan": [], "other": []}

    def keep(name, cells, batch):
        have = sum(len(c) for c, _ in voxels[name])
        if have < per_rank and len(cells):
            take = per_rank - have
            voxels[name].append((np.asarray(cells[:take], np.float32),
                                 np.asarray(batch["energy"][:take]) * 100.0))

    for start in range(0, len(mine), 64):
        index = mine[start:start + 64]
        raw = {**files.read(index), "_index": index}
        batch = task.preprocess(raw)
        if generated is None:
            images = task.generate(batch["energy"], batch.get("angle"), batch["_index"])
            fake_gev = task.preprocess.to_gev(images)
            gan_parts.append(_observe(task, {**batch, "images": images}, fake_gev))
            keep("gan", fake_gev, batch)
        elif len(index[index < len(generated)]):  # its own events, filtered as the MC's are
            gen_index = index[index < len(generated)]   # (a shorter file: fewer showers)
            fake_raw = {**generated.read(gen_index), "_index": gen_index}
            fake_batch = task.preprocess(fake_raw)
            fake_gev = _cells_gev(task, fake_raw, fake_batch["_index"])
            gan_parts.append(_observe(task, fake_batch, fake_gev))
            keep("gan", fake_gev, fake_batch)
        cells = _cells_gev(task, raw, batch["_index"])
        mc_parts.append(_observe(task, batch, cells))
        keep("mc", cells, batch)
    mine = other[rank::size]  # the floor's second MC half: observables only
    for start in range(0, len(mine), 64):
        index = mine[start:start + 64]
        raw = {**files.read(index), "_index": index}
        batch = task.preprocess(raw)
        cells = _cells_gev(task, raw, batch["_index"])
        other_parts.append(_observe(task, batch, cells))
        keep("other", cells, batch)
    other_all = comm.gather(concat(other_parts), root=0)
    voxels = comm.gather(voxels, root=0) if voxel_events else None
    mc_all = comm.gather(concat(mc_parts), root=0)
    gan_all = comm.gather(concat(gan_parts), root=0)
    result = None
    if comm.Get_rank() == 0:
        try:
            result = _score_and_plot(task, mc_all, gan_all, other_all, folder, plots, generated,
                                     title, classifier, seeds, voxels, device)
        except Exception as err:  # raised on every rank below, not on rank 0 alone
            result = err
    from ..core.comm import wait_idle

    wait_idle(comm)  # the others wait asleep while rank 0 scores and plots
    result = comm.bcast(result, root=0)
    if isinstance(result, Exception):
        raise result
    return result


def _joined(parts, name):
    """(cells, energies) of one sample's voxel subsample from every rank's parts."""
    pieces = [p for rank in parts for p in rank[name]]
    if not pieces:
        return np.zeros((0, 1), np.float32), np.zeros(0)
    return np.concatenate([c for c, _ in pieces]), np.concatenate([e for _, e in pieces])


def _score_and_plot(task, mc_all, gan_all, other_all, folder, plots, generated, title,
                    classifier, seeds, voxels=None, device="cpu") -> dict:
    """Rank 0: validate_task's scoring, JSON and plots from the gathered observables."""
    mc, gan = concat(mc_all), concat(gan_all)
    if not mc:
        result = {"score": None, "events": 0}
    else:
        with_angle = task.variant == "angle"
        paired = None
        if generated is not None:
            paired = condition_mismatch(mc, gan) if gan else {}
            _refuse_mismatch(paired, gan)
            mc, gan = pair_by_conditions(mc, gan)
        result, mc_other = with_floor(score(mc, gan, with_angle, classifier, seeds), mc,
                                      concat(other_all), with_angle, classifier, seeds)
        if paired is not None:
            result["generated_condition_mismatch"] = paired
        if voxels:
            from .challenge import voxel_auc

            result.update(voxel_auc(_joined(voxels, "mc"), _joined(voxels, "gan"),
                                    _joined(voxels, "other"), seeds, device))
        if folder:
            os.makedirs(folder, exist_ok=True)
            if plots:
                from .plots import plot

                result["plots"] = plot(mc, gan, folder, title=title,
                                       label="GAN" if generated is None else "generated",
                                       floor=mc_other)
            from ..core.io import atomic_write_text

            atomic_write_text(os.path.join(folder, "validation.json"),
                              json.dumps(result, indent=2))
    return result
