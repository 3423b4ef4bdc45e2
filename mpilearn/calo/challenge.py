"""The CaloChallenge 2022 metrics (arXiv 2410.21611) on the 51x51x25 geometry, computed from
``physics.features``' per-event observables (the voxel classifier from the cells).

High-level features, one row per shower (``high_level``): log10 E_inc, E_tot/E_inc, log10 of
the energy in each of the 25 layers, the centre of energy and the width (the square root of
the second central moment) in x and y (cell units), the sparsity (the fraction of cells with
no energy) and the measured angle (radians, angle model). Energies enter as log10(E/GeV +
1e-8), as the CaloChallenge's ``prepare_high_data_for_classifier`` does.

- ``separation_power``: per feature, 0.5 sum_i (h1_i - h2_i)^2 / (h1_i + h2_i) of the two
  normalised histograms (bins spanning the MC's range; values beyond it fall in the edge bins).
- ``fpd`` / ``kpd``: the Fréchet and kernel physics distances of Kansal et al. 2023 with
  ``jetnet.evaluation.fpd/kpd``'s semantics: features divided by the MC's largest |value|;
  FPD's mean over ``num_batches`` random batches at ``num_points`` sizes evenly spaced in 1/N,
  extrapolated to 1/N = 0 by a non-negative linear fit (value, and the fit's error on the
  intercept, to which we add in quadrature the samples' own fluctuation, read from the spread
  of the batches at each size: ``_sample_spread``); KPD's unbiased MMD^2 with the polynomial kernel (x.y/d + 1)^4 (jetnet's code uses
  degree 4, so the numbers compare with the CaloChallenge's, which called jetnet), median over
  batches and half the 16-84 % inter-quantile range as its error.
  Changes for validation-sized samples (jetnet asks for 50 000 events): FPD's batches are drawn
  without replacement, at sizes from ``min_fraction`` of the sample to 80 % of it (drawn with
  replacement from N events, each batch repeats events, which biases the distance upwards by
  ~1/N, so that two MC samples would not score 0 within errors); KPD's batches, where the
  sample holds fewer than ``num_batches`` x ``batch_size`` events, are its disjoint tenths, so
  that their spread is the error of independent estimates and not of overlapping draws.
- ``classifier_auc``: the CaloChallenge's protocol (``code/evaluate.py``): an MLP with leaky
  ReLUs told generated from MC, the events split 60/20/20 into train/test/validation, the
  epoch with the best test accuracy kept, its outputs calibrated by isotonic regression on the
  test split and the AUC measured on the validation split; mean and std over ``seeds`` splits
  and initialisations. Sizes are small (CPU): 2 hidden layers of 64 (the challenge: 2048),
  inputs standardised by the training split. ``voxel_auc``: the same on the 65 025 cells and
  log10 E_inc (the "low-level" classifier), on a subsample on CPU, with 2 hidden layers of 32
  and 20 epochs (the cells that neither sample ever fills left out: most of the cost).
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

LOG_OFFSET = 1e-8   # GeV: log10(E + 1e-8), as the CaloChallenge's feature preparation


def high_level(f: Dict[str, np.ndarray]) -> Tuple[list, np.ndarray]:
    """(names, (N, D) matrix) of the high-level features of a ``physics.features`` sample."""
    energy = np.asarray(f["energy"], dtype=np.float64)
    layers = np.asarray(f["profile_z"], dtype=np.float64)
    cols = {"log10_e_inc": np.log10(energy),
            "e_tot_over_e_inc": f["sum"] / energy}
    for i in range(layers.shape[1]):
        cols[f"log10_e_layer_{i:02d}"] = np.log10(layers[:, i] + LOG_OFFSET)
    for a, axis in enumerate("xy"):
        cols[f"centre_{axis}"] = f["moments"][:, a, 0]
    for a, axis in enumerate("xy"):
        cols[f"width_{axis}"] = np.sqrt(np.maximum(f["moments"][:, a, 1], 0.0))
    cols["sparsity"] = 1.0 - f["sparsity"][:, 0]   # above 1e-13 GeV: any energy
    if "condition_angle" in f:
        cols["measured_angle"] = f["angle"]
    matrix = np.stack(list(cols.values()), 1) if len(energy) else np.zeros((0, len(cols)))
    # an empty generated shower has no angle: 0, far from every MC value, as it should score
    return list(cols), np.nan_to_num(matrix, nan=0.0, posinf=0.0, neginf=0.0)


def separation_power(mc: np.ndarray, gen: np.ndarray, bins: int = 30) -> np.ndarray:
    """Per column: 0.5 sum (h1 - h2)^2 / (h1 + h2) of normalised histograms (0: identical,
    1: disjoint), bins spanning the MC's range."""
    out = []
    for a, b in zip(np.atleast_2d(mc.T), np.atleast_2d(gen.T)):
        lo, hi = a.min(), a.max()
        if hi <= lo:
            hi = lo + 1e-9
        edges = np.linspace(lo, hi, bins + 1)
        h1 = np.histogram(np.clip(a, lo, hi), edges)[0].astype(np.float64)
        h2 = np.histogram(np.clip(b, lo, hi), edges)[0].astype(np.float64)
        h1, h2 = h1 / max(h1.sum(), 1), h2 / max(h2.sum(), 1)
        both = h1 + h2
        keep = both > 0
        out.append(0.5 * float(((h1[keep] - h2[keep]) ** 2 / both[keep]).sum()))
    return np.array(out)


def _normalised(x: np.ndarray, y: np.ndarray):
    scale = np.max(np.abs(x), axis=0)
    scale[scale == 0] = 1.0   # a feature that is 0 everywhere stays as it is
    return x / scale, y / scale


def frechet_distance(x: np.ndarray, y: np.ndarray) -> float:
    """|mu_x - mu_y|^2 + tr(S_x + S_y - 2 (S_x S_y)^1/2) of two samples' Gaussians."""
    mx, my = x.mean(0), y.mean(0)
    sx, sy = np.atleast_2d(np.cov(x, rowvar=False)), np.atleast_2d(np.cov(y, rowvar=False))
    # tr (S_x S_y)^1/2 = sum of sqrt of the eigenvalues of S_x^1/2 S_y S_x^1/2 (symmetric PSD)
    w, v = np.linalg.eigh(sx)
    root = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    cross = np.sqrt(np.clip(np.linalg.eigvalsh(root @ sy @ root), 0, None)).sum()
    return float(((mx - my) ** 2).sum() + np.trace(sx) + np.trace(sy) - 2 * cross)


def fpd(mc: np.ndarray, gen: np.ndarray, min_fraction: float = 0.2, num_batches: int = 20,
        num_points: int = 10, normalise: bool = True, seed: int = 42) -> Tuple[float, float]:
    """(FPD extrapolated to infinitely many events, its error); see the module doc."""
    from scipy.optimize import curve_fit

    x, y = (_normalised(mc, gen) if normalise else (mc, gen))
    n = min(len(x), len(y))
    top = max(2, int(0.8 * n))
    sizes = (1.0 / np.linspace(1.0 / max(2, int(min_fraction * n)), 1.0 / top, num_points))
    sizes = np.unique(sizes.astype(int))
    rng = np.random.default_rng(seed)
    batches = [[frechet_distance(x[rng.choice(len(x), size, replace=False)],
                                 y[rng.choice(len(y), size, replace=False)])
                for _ in range(num_batches)] for size in sizes]
    means = [np.mean(b) for b in batches]
    if len(sizes) < 2:
        return float(means[0]), float("nan")
    params, cov = curve_fit(lambda inv, a, b: a + b * inv, 1.0 / sizes, means,
                            bounds=([0, 0], [np.inf, np.inf]))
    return float(params[0]), float(np.hypot(np.sqrt(cov[0, 0]), _sample_spread(batches, sizes, n)))


def _sample_spread(batches, sizes, n: int) -> float:
    """The batches share the two samples' events, so the fit's error misses those samples' own
    fluctuation. Batches of m of the n events drawn without replacement vary, given the
    samples, as var_m (1 - m/n) ~ var_n (n/m - 1) (a distance whose fluctuation is linear in
    the events, 1/m); so var_n, averaged over the sizes. Where the distance's fluctuation is
    quadratic (two samples of one distribution: var ~ 1/m^2) this overstates it, about twice,
    which keeps MC against MC at its floor; a 7 % energy-scale error is then > 3 σ at 2 000
    events a side, where slope / N (the earlier term, 3-4x too large) left it at ~2 σ."""
    spreads = [np.var(b, ddof=1) / (n / m - 1) for b, m in zip(batches, sizes)
               if len(b) > 1 and m < n]
    return float(np.sqrt(np.mean(spreads))) if spreads else 0.0


def mmd_poly_unbiased(x: np.ndarray, y: np.ndarray, degree: int = 4) -> float:
    """Unbiased MMD^2 with the kernel (x.y / d + 1)^degree (d: the feature count)."""
    gamma = 1.0 / x.shape[1]
    kxx = (x @ x.T * gamma + 1.0) ** degree
    kyy = (y @ y.T * gamma + 1.0) ** degree
    kxy = (x @ y.T * gamma + 1.0) ** degree
    m, n = len(x), len(y)
    return float((kxx.sum() - np.trace(kxx)) / (m * (m - 1))
                 + (kyy.sum() - np.trace(kyy)) / (n * (n - 1)) - 2 * kxy.mean())


def kpd(mc: np.ndarray, gen: np.ndarray, num_batches: int = 10, batch_size: int = 5000,
        normalise: bool = True, seed: int = 42) -> Tuple[float, float]:
    """(median over batches of the unbiased MMD^2, half the 16-84 % range); see the module doc."""
    x, y = (_normalised(mc, gen) if normalise else (mc, gen))
    n = min(len(x), len(y))
    if n >= num_batches * batch_size:   # jetnet's draw: batches nearly independent
        picks = [(np.random.default_rng(seed + 1000 * i).choice(len(x), batch_size, replace=False),
                  np.random.default_rng(seed + 1000 * i + 1).choice(len(y), batch_size,
                                                                     replace=False))
                 for i in range(num_batches)]
    else:   # a small sample: disjoint batches, so that their spread is an honest error
        rng = np.random.default_rng(seed)
        px, py = rng.permutation(len(x))[:n], rng.permutation(len(y))[:n]
        picks = list(zip(np.array_split(px, num_batches), np.array_split(py, num_batches)))
    values = [mmd_poly_unbiased(x[i], y[j]) for i, j in picks if len(i) > 1 and len(j) > 1]
    lo, hi = np.percentile(values, [16.275, 83.725])
    return float(np.median(values)), float((hi - lo) / 2)


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """The area under the ROC curve (Mann-Whitney, ties counted half)."""
    from scipy.stats import rankdata

    labels = np.asarray(labels, dtype=bool)
    pos, neg = labels.sum(), (~labels).sum()
    if not pos or not neg:
        return float("nan")
    ranks = rankdata(scores)
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def isotonic(x: np.ndarray, y: np.ndarray):
    """The non-decreasing step function of x fitting y best in least squares (pool adjacent
    violators); returns a function clipping to the fitted range, as the challenge's
    ``IsotonicRegression(out_of_bounds='clip')``."""
    order = np.argsort(x, kind="stable")
    xs, ys = np.asarray(x, np.float64)[order], np.asarray(y, np.float64)[order]
    values, weights, ends = [], [], []
    for i, v in enumerate(ys):
        values.append(v), weights.append(1.0), ends.append(i)
        while len(values) > 1 and values[-2] > values[-1]:
            w = weights[-2] + weights[-1]
            values[-2] = (values[-2] * weights[-2] + values[-1] * weights[-1]) / w
            weights[-2], ends[-2] = w, ends[-1]
            del values[-1], weights[-1], ends[-1]
    upper = xs[np.array(ends)]   # each block's largest x
    fitted = np.clip(np.array(values), 1e-6, 1 - 1e-6)

    def predict(z):
        return fitted[np.clip(np.searchsorted(upper, z, side="left"), 0, len(fitted) - 1)]

    return predict


def _one_classifier(x: np.ndarray, labels: np.ndarray, seed: int, hidden: int, layers: int,
                    epochs: int, batch_size: int, lr: float, device: str = "cpu") -> float:
    import torch

    rng = np.random.default_rng(seed)
    parts = {}
    for label in (0, 1):   # each class split 60/20/20, as ttv_split
        idx = rng.permutation(np.nonzero(labels == label)[0])
        cut = (len(idx) * np.array([0.6, 0.8])).astype(int)
        for name, part in zip(("train", "test", "val"), np.split(idx, cut)):
            parts[name] = np.concatenate([parts.get(name, np.zeros(0, int)), part])
    mean, std = x[parts["train"]].mean(0), x[parts["train"]].std(0)
    std[std == 0] = 1.0
    data = {k: (torch.tensor((x[v] - mean) / std, dtype=torch.float32, device=device),
                torch.tensor(labels[v], dtype=torch.float32, device=device))
            for k, v in parts.items()}
    torch.manual_seed(seed)
    sizes = [x.shape[1]] + [hidden] * (layers + 1)
    net = torch.nn.Sequential(*[m for a, b in zip(sizes[:-1], sizes[1:])
                                for m in (torch.nn.Linear(a, b), torch.nn.LeakyReLU())],
                              torch.nn.Linear(hidden, 1)).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    best, best_state = -1.0, None
    xt, yt = data["train"]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        net.train()
        for batch in torch.randperm(len(xt), generator=gen).to(device).split(batch_size):
            opt.zero_grad()
            loss_fn(net(xt[batch])[:, 0], yt[batch]).backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            accuracy = ((net(data["test"][0])[:, 0] > 0).float() == data["test"][1]).float().mean().item()
        if accuracy > best:
            best, best_state = float(accuracy), {k: v.clone() for k, v in net.state_dict().items()}
    net.load_state_dict(best_state)
    with torch.no_grad():
        test_p = torch.sigmoid(net(data["test"][0])[:, 0]).cpu().numpy()
        val_p = torch.sigmoid(net(data["val"][0])[:, 0]).cpu().numpy()
    calibrate = isotonic(test_p, data["test"][1].cpu().numpy())
    return auc(data["val"][1].cpu().numpy(), calibrate(val_p))


def classifier_auc(mc: np.ndarray, gen: np.ndarray, seeds: int = 5, hidden: int = 64,
                   layers: int = 2, epochs: int = 30, batch_size: int = 128,
                   lr: float = 1e-3, device: str = "cpu", one_thread: bool = True) -> dict:
    """The calibrated validation AUC of an MLP told ``gen`` (label 1) from ``mc`` (label 0):
    mean, std and the values over ``seeds`` splits and initialisations (``one_thread``: small
    nets run fastest on one thread, and leave the others be)."""
    import torch

    x = np.concatenate([mc, gen])   # float32 voxels stay float32 (memory)
    labels = np.concatenate([np.zeros(len(mc)), np.ones(len(gen))])
    threads = torch.get_num_threads()
    if one_thread:
        torch.set_num_threads(1)
    try:
        values = [_one_classifier(x, labels, s, hidden, layers, epochs, batch_size, lr, device)
                  for s in range(seeds)]
    finally:
        torch.set_num_threads(threads)
    return {"mean": float(np.mean(values)), "std": float(np.std(values)), "values": values}


def metrics(mc: Dict[str, np.ndarray], gen: Dict[str, np.ndarray], classifier: bool = False,
            seeds: int = 5) -> dict:
    """The challenge's numbers for two paired samples of ``physics.features``: FPD, KPD and
    their errors, the separation power (mean over features, and each feature's under
    ``separation_power_features``), and with ``classifier`` the high-level AUC."""
    names, x = high_level(mc)
    _, y = high_level(gen)
    out = {}
    if len(x) < 10 or len(y) < 10:
        return out
    sep = separation_power(x, y)
    out["separation_power"] = float(sep.mean())
    out["separation_power_features"] = dict(zip(names, map(float, sep)))
    out["fpd"], out["fpd_error"] = fpd(x, y)
    out["kpd"], out["kpd_error"] = kpd(x, y)
    if classifier:
        result = classifier_auc(x, y, seeds=seeds)
        out["auc_high"], out["auc_high_error"] = result["mean"], result["std"]
        out["auc_high_seeds"] = result["values"]
    return out


def voxel_inputs(cells_gev: np.ndarray, energy_gev: np.ndarray) -> np.ndarray:
    """The low-level classifier's inputs, as the challenge's ``prepare_low_data_for_classifier``
    (unnormalised): log10 E_inc, then every cell's energy (GeV)."""
    n = len(cells_gev)
    return np.concatenate([np.log10(np.asarray(energy_gev, np.float32)).reshape(n, 1),
                           np.asarray(cells_gev, np.float32).reshape(n, -1)], 1)


def _filled(x: np.ndarray, y: np.ndarray):
    """Both samples without the cells that neither ever fills (constant 0: no information,
    and most of the 65 025 columns' cost)."""
    cols = (x != 0).any(0) | (y != 0).any(0)
    return x[:, cols], y[:, cols]


def voxel_auc(mc: tuple, gen: tuple, other: tuple, seeds: int = 5, device: str = "cpu") -> dict:
    """The low-level (voxel) classifier AUC of ``gen`` against ``mc`` and its floor (``other``,
    a disjoint MC sample, against ``mc``); each sample (cells in GeV, primary energies).
    ``auc_low``, ``auc_low_error`` (std over seeds), ``auc_low_floor``, ``auc_low_ratio``."""
    out = {}
    if len(mc[0]) < 10 or len(gen[0]) < 10:
        return out
    x = voxel_inputs(*mc)
    net = {"seeds": seeds, "device": device, "hidden": 32, "epochs": 20}
    got = classifier_auc(*_filled(x, voxel_inputs(*gen)), **net)
    out.update(auc_low=got["mean"], auc_low_error=got["std"], auc_low_events=len(mc[0]))
    if len(other[0]) >= 10:
        floor = classifier_auc(*_filled(x, voxel_inputs(*other)), **net)
        out.update(auc_low_floor=floor["mean"], auc_low_floor_error=floor["std"],
                   auc_low_ratio=got["mean"] / floor["mean"])
    return out
