"""python -m mpilearn.simulate: cheap synthetic electromagnetic showers (no Geant4).

Recipe of reference 3dgan.md §6, vectorised over events with numpy:
  * Grindhammer-Peters longitudinal profile (GFlash parameters for a W/Si sampling calorimeter)
    with correlated (ln T, ln α) fluctuations; energy behind the 25 layers leaks out, so the
    sampling fraction falls with energy;
  * a two-component (core + tail) radial profile drawn as spots with the exact inverse CDF;
  * the incident angle tilts the shower axis in y by cot θ cells per layer around its
    barycentre layer, so the §4c measured angle recovers θ;
  * the reference's ≈2 % sampling-fraction fit with Gamma-distributed spot energies (16.6 %/√E resolution).
Files have the keys, units and names of the real data sets.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

from ..cluster.launcher import RankZeroArgumentParser

# .format imports torch, scipy is slow to import: both are imported where used, so that --help stays quick

Z_W = 74.0
EC_GEV = 0.0094          # effective critical energy of the W/Si stack
F_S, E_HAT = 1.45, 0.70  # sampling frequency and e/mip of the stack
RM_CELLS = 9.5 / 5.1     # effective Molière radius in 5.1 mm cells
LAYER_X0 = np.array([0.685] * 17 + [1.37] * 8)  # CLIC ECAL: 17 thin + 8 thick W layers


def visible_fraction(energy: np.ndarray) -> np.ndarray:
    """Sampling fraction of the 25³ GetEcalFit (2.18 % at 10 GeV, 1.81 % at 500 GeV)."""
    x = energy / 100.0
    return (0.0018 * x ** 4 - 0.023 * x ** 3 + 0.11 * x ** 2 - 0.28 * x + 2.21) / 100.0

RESOLUTION = 0.166       # stochastic term, GeV^0.5
SPOTS = 1500


def longitudinal(energy: np.ndarray, sin_theta: np.ndarray, rng) -> tuple:
    """Per-event fraction of the energy deposited in each of the 25 layers, and T (X0)."""
    from scipy.special import gammainc

    ln_y = np.log(energy / EC_GEV)
    mean_ln_t = np.log(np.maximum(np.exp(np.log(ln_y - 0.812)) - 0.55 / F_S - 0.69 * (1 - E_HAT), 0.5))
    mean_ln_a = np.log(np.maximum(0.81 + (0.458 + 2.26 / Z_W) * ln_y - 0.476 / F_S, 1.1))
    sig_t = 1.0 / np.maximum(-2.5 + 1.25 * ln_y, 1.0)
    sig_a = 1.0 / np.maximum(-0.82 + 0.79 * ln_y, 1.0)
    rho = np.clip(0.784 - 0.023 * ln_y, -0.99, 0.99)
    z1, z2 = rng.standard_normal((2, len(energy)))
    ln_t = mean_ln_t + sig_t * (z1 * np.sqrt((1 + rho) / 2) + z2 * np.sqrt((1 - rho) / 2))
    ln_a = mean_ln_a + sig_a * (z1 * np.sqrt((1 + rho) / 2) - z2 * np.sqrt((1 - rho) / 2))
    T, alpha = np.exp(ln_t), np.maximum(np.exp(ln_a), 1.05)
    beta = (alpha - 1) / T
    edges = np.concatenate([[0.0], np.cumsum(LAYER_X0)])[None, :] / sin_theta[:, None]
    cdf = gammainc(alpha[:, None], beta[:, None] * edges)
    return np.diff(cdf, axis=1), T, edges


def radial_params(energy: np.ndarray, tau: np.ndarray) -> tuple:
    """GFlash core radius, tail radius (Molière units) and core probability at depth τ = t/T."""
    ln_e = np.log(energy)[:, None]
    rc = 0.0251 + 0.00319 * ln_e + (0.1162 - 0.000381 * Z_W) * tau
    k1, k2, k3 = 0.659 - 0.00309 * Z_W, 0.645, -2.59
    k4 = 0.3585 + 0.0412 * ln_e
    rt = k1 * (np.exp(k3 * (tau - k2)) + np.exp(k4 * (tau - k2)))
    p1, p2 = 2.632 - 0.00094 * Z_W, 0.401 + 0.00187 * Z_W
    p3 = 1.313 - 0.0686 * ln_e
    arg = (p2 - tau) / p3
    p = np.clip(p1 * np.exp(arg - np.exp(arg)), 0.0, 1.0)
    return rc, rt, p


def showers(energy: np.ndarray, theta: np.ndarray, shape, rng) -> np.ndarray:
    """Cell energies in GeV, (N, X, Y, Z), for primaries of ``energy`` GeV at polar angle θ."""
    n = len(energy)
    nx, ny, nz = shape
    fractions, T, edges = longitudinal(energy, np.sin(theta), rng)
    mids = 0.5 * (edges[:, 1:] + edges[:, :-1]) * np.sin(theta)[:, None]  # depth in X0 along axis
    rc, rt, p = radial_params(energy, mids / T[:, None])
    # spots per layer ∝ deposited fraction; the rest of the spots stand for leakage
    layer_of = np.empty((n, SPOTS), dtype=np.int64)
    totals = fractions.sum(1)
    cum = np.cumsum(fractions / totals[:, None], axis=1)
    layer_of[:] = np.minimum((rng.random((n, SPOTS))[..., None] > cum[:, None, :]).sum(-1), nz - 1)
    rows = np.arange(n)[:, None]
    core = rng.random((n, SPOTS)) < p[rows, layer_of]
    radius = np.where(core, rc[rows, layer_of], rt[rows, layer_of]) * RM_CELLS
    u = rng.random((n, SPOTS)) * 0.999
    r = radius * np.sqrt(u / (1 - u))
    phi = rng.random((n, SPOTS)) * 2 * math.pi
    zc = layer_of + 0.5
    z_bary = (fractions * (np.arange(nz) + 0.5)).sum(1) / totals
    shift = rng.uniform(-0.5, 0.5, size=(2, n))
    x = nx / 2 + shift[0][:, None] + r * np.cos(phi)
    y = ny / 2 + shift[1][:, None] + (zc - z_bary[:, None]) / np.tan(theta)[:, None] + r * np.sin(phi)
    # visible energy with sampling fluctuations: Gamma-distributed spot energies
    visible = visible_fraction(energy) * energy * totals
    k = np.maximum(energy / (RESOLUTION ** 2 * SPOTS), 1e-3)
    spot_e = rng.gamma(k[:, None], 1.0, size=(n, SPOTS))
    spot_e *= (visible / np.maximum(spot_e.sum(1), 1e-12))[:, None] * rng.gamma(
        energy * totals / RESOLUTION ** 2, RESOLUTION ** 2 / (energy * totals))[:, None]
    ix, iy = np.floor(x).astype(np.int64), np.floor(y).astype(np.int64)
    inside = (ix >= 0) & (ix < nx) & (iy >= 0) & (iy < ny)
    flat = ((rows * nx + ix) * ny + iy) * nz + layer_of
    out = np.bincount(flat[inside], weights=spot_e[inside], minlength=n * nx * ny * nz)
    out = out.reshape(n, nx, ny, nz)
    out[out < 1e-6] = 0.0
    return out


def file_name(geometry: str, emin: float, emax: float, index: int) -> str:
    if geometry == "angle":
        return f"Ele_VarAngleMeas_{emin:g}_{emax:g}_{index:03d}.h5"
    return f"EleEscan_1_{index:03d}.h5"


def write_file(path: str, geometry: str, events: int, emin: float, emax: float, rng,
               chunk: int = 100, progress=None) -> None:
    import h5py

    from ..core.io import atomic_write_bytes
    from .format import GEOMETRY, measured_angle_np

    g = GEOMETRY[geometry]
    energy = rng.uniform(emin, emax, events)
    theta = (rng.uniform(math.radians(60), math.radians(120), events) if geometry == "angle"
             else np.full(events, math.pi / 2))
    parts = []
    for start in range(0, events, chunk):
        sl = slice(start, start + chunk)
        parts.append(showers(energy[sl], theta[sl], g["shape"], rng).astype(np.float32))
        if progress is not None:
            progress.update(len(parts[-1]))
    gev = np.concatenate(parts) if parts else np.zeros((0,) + g["shape"], np.float32)
    raw = (gev * g["unit"]).astype(np.float32)

    def write(f):
        with h5py.File(f, "w") as h:
            opts = {"compression": "gzip", "compression_opts": 1, "chunks": (1,) + g["shape"]}
            h.create_dataset("ECAL", data=raw, **opts)
            h.create_dataset("energy", data=energy.astype(np.float32))
            if geometry == "angle":
                h.create_dataset("theta", data=theta.astype(np.float32))
                h.create_dataset("eta", data=(-np.log(np.tan(theta / 2))).astype(np.float32))
                h.create_dataset("mtheta", data=measured_angle_np(gev).astype(np.float32))
                h.create_dataset("sum", data=raw.reshape(events, -1).sum(1))
            else:
                target = np.zeros((events, 5), np.float32)
                target[:, 0], target[:, 1] = 11, energy
                h.create_dataset("target", data=target)

    atomic_write_bytes(path, write)


def simulate(output: str, events: int, geometry: str = "angle", energy=(100.0, 200.0),
             seed: int = 0, events_per_file: int = 5000, progress: bool = True) -> list:
    """Writes ``events`` showers into ``output``/; returns the file paths."""
    os.makedirs(output, exist_ok=True)
    rng = np.random.default_rng(seed)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=events, desc="simulating", unit="event", file=sys.stderr)
    paths, index = [], 0
    for start in range(0, events, events_per_file):
        n = min(events_per_file, events - start)
        path = os.path.join(output, file_name(geometry, energy[0], energy[1], index))
        write_file(path, geometry, n, energy[0], energy[1], rng, progress=bar)
        paths.append(path)
        index += 1
    if bar is not None:
        bar.close()
    return paths


def main(argv=None) -> int:
    p = RankZeroArgumentParser(prog="python -m mpilearn.simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=1000)
    p.add_argument("--output", default="data/synthetic", help="folder for the HDF5 files")
    p.add_argument("--geometry", choices=("angle", "fixed"), default="angle",
                   help="angle: 51x51x25 GeVx50 with θ in 60-120°; fixed: 25x25x25 GeV, θ=90°")
    p.add_argument("--energy", type=float, nargs=2, default=(100.0, 200.0), metavar=("MIN", "MAX"),
                   help="primary energy range in GeV (uniform)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--events-per-file", type=int, default=5000)
    args = p.parse_args(argv)
    if args.events < 1 or args.events_per_file < 1:
        p.error("--events and --events-per-file must be positive")
    if not 0 < args.energy[0] <= args.energy[1]:
        p.error(f"--energy needs 0 < MIN <= MAX, got {args.energy[0]:g} {args.energy[1]:g}")
    paths = simulate(args.output, args.events, args.geometry, tuple(args.energy), args.seed,
                     args.events_per_file)
    print("\n".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
