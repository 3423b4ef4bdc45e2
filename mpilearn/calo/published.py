"""The CaloChallenge 2022's published reference points (Krause et al., arXiv 2410.21611), for
the verdicts of ``validate`` and ``report``: where a generator's numbers sit among Geant4
against itself, the best entry and the GANs.

The numbers are the challenge's own results files (github CaloChallenge/homepage,
``final_results/CaloChallenge_results_ds2.hdf``, whose README says they hold every number of the
paper's tables and figures): dataset 2, electrons of 1 GeV-1 TeV in 45x16x9 voxels, the closest
of its datasets to the 3DGAN's electrons. FPD and KPD are given raw here (the files hold them
x10^3). They are distances on the challenge's own features of its own geometry, so only their
orders of magnitude compare with ours; the classifier AUCs read alike anywhere (0.5: cannot
tell, 1: always can), although ours is a smaller classifier (``challenge.py``), which can only
tell less. The GANs of dataset 2 are DeepTree and MDMA (its other GANs entered dataset 1 only).
"""
from __future__ import annotations

from typing import Optional

SOURCE = "CaloChallenge 2022, dataset 2 (electrons)"

# name: (Geant4 against Geant4, (best entry, its value), [(a GAN, its value), ...])
POINTS = {
    "fpd": (0.010776, ("CaloDREAM", 0.024649), [("DeepTree", 0.29263), ("MDMA", 0.86498)]),
    "kpd": (-0.0000276, ("CaloDREAM", 0.0000231), [("DeepTree", 0.00068), ("MDMA", 0.0049624)]),
    "auc_high": (0.49927, ("CaloDREAM", 0.52079), [("DeepTree", 0.92704), ("MDMA", 0.98673)]),
    "auc_low": (0.49961, ("CaloDREAM", 0.53082), [("DeepTree", 0.96283), ("MDMA", 0.94155)]),
}


def gans_text(name: str) -> str:
    """The published GANs' values of one metric, e.g. "DeepTree 0.927, MDMA 0.987"."""
    return ", ".join(f"{g} {v:.3g}" for g, v in POINTS[name][2])


def reference_line(name: str) -> Optional[str]:
    """The published points of one metric in a line, or None for a metric they do not have."""
    if name not in POINTS:
        return None
    geant4, (best, value), _ = POINTS[name]
    return (f"{name}: Geant4 against itself {geant4:.3g}, the best entry {value:.3g} ({best}), "
            f"the GANs {gans_text(name)}")


def place(name: str, value) -> Optional[str]:
    """Where a classifier AUC sits among the published points, in words (None for other
    metrics: the distances' numbers do not compare across geometries)."""
    if not name.startswith("auc") or name not in POINTS or not isinstance(value, (int, float)):
        return None
    geant4, (best, best_value), gans = POINTS[name]
    low_gan = min(v for _, v in gans)
    if value <= best_value:
        return f"as hard to tell as the best published entry ({best}, {best_value:.3g}) or harder"
    if value < low_gan:
        return (f"between the best published entry ({best_value:.3g}) and the published GANs "
                f"({low_gan:.3g}+)")
    return f"as easy to tell as the published GANs ({low_gan:.3g}+) or easier"


def reference_lines(names) -> list:
    """The verdict's closing lines for the metrics in ``names`` that have published points."""
    lines = [reference_line(n) for n in names]
    lines = [line for line in lines if line]
    if not lines:
        return []
    return ([f"published reference points ({SOURCE}; FPD and KPD on its own features and "
             "geometry, compare orders of magnitude only):"] + [f"  {line}" for line in lines])
