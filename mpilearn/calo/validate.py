"""python -m mpilearn.validate: physics validation of 3DGAN showers against Monte Carlo.

    python -m mpilearn.validate --checkpoint runs/demo/checkpoints/latest --mc data/*.h5
    mpirun -np 4 python -m mpilearn.validate --checkpoint ... --mc ... --events 5000

Every MC event is used by default: a seeded half (--seed) is compared, the other half gives the
MC-vs-MC floor, so the same MC file gives the same floor, whatever it is compared with.
    python -m mpilearn.validate --generated other_gan/*.h5 --mc data/*.h5 --json out.json

For every MC event, one shower is generated from the checkpoint with the same (E, θ), or, with
--generated, read from showers in the calorimeter's HDF5 format (another generator's output,
or a second MC sample), each carrying its own conditioning (energy, and the angle key for the
angle model): they are paired with the MC by (E, θ), as the floor's second MC half is, and
refused when made for other conditions. The §4b observables are compared, and these numbers
reported, each beside its MC-vs-MC floor and ratio, or distance from it in σ (see ``mpilearn.calo.physics``,
``mpilearn.calo.reference`` and ``mpilearn.calo.challenge``):
  score                  mpilearn's physics score (lower is better);
  reference_metric       the reference analysis's optimisation metric (moments, profiles,
                         angle), on its event selection;
  sampling_fraction_mre  the reference's epoch-selection MRE, with its value per energy bin;
  fpd, kpd               the CaloChallenge's Fréchet and kernel physics distances on the
                         high-level features, with their errors;
  separation_power       the mean over those features of their histograms' separation power;
  auc_high               the high-level classifier's calibrated AUC, mean ± std over --seeds
                         (0.5: the classifier cannot tell; --no-classifier skips it);
  auc_low                the voxel classifier's, on --voxel-events events (--full: all, on
                         the GPU where there is one).
Writes ``validation.json`` and PNG plots into ``--output``, and the results to ``--json``, and
ends with a verdict per metric family: "at the MC floor" where a number is within the floor's
noise (MC against MC is), else how many times the floor (a classifier: its AUC, 0.5 = cannot
tell). FPD and KPD, whose floor is 0 within its error, are given as their distance from it in
standard deviations, (value - floor) / sqrt(error^2 + floor_error^2), beside the floor and its
error: ``fpd 83.45 ± 0.5 (3 700 σ; MC floor 0.0000 ± 0.022)``; 3 σ or more is told from the MC.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional
from types import SimpleNamespace

import numpy as np

from ..cluster.launcher import RankZeroArgumentParser
from ..core.comm import check_on_root
from ..errors import UsageError, exit_status
# .runs imports torch: it is imported where used, so that --help stays quick


def prepare(args):
    """Rank 0: check every input before anything is built or read."""
    from ..core.builders import load_builder
    from ..train.checks import expand_files
    from .runs import resolve_checkpoint, run_config

    if not args.checkpoint and not args.generated:
        raise UsageError("give --checkpoint (generate showers) or --generated (read them)")
    if args.voxel_events < 0:
        raise UsageError(f"--voxel-events {args.voxel_events}: give 0 (none) or more")
    if args.events is not None and args.events < 1:
        raise UsageError(f"--events {args.events}: give at least 1 (default: half the MC)")
    if args.seeds < 1:
        raise UsageError(f"--seeds {args.seeds}: give at least 1 classifier run")
    if args.json and os.path.isdir(args.json):
        raise UsageError(f"--json {args.json} is a folder, not a file")
    checkpoint = config = None
    if args.checkpoint:
        checkpoint = resolve_checkpoint(args.checkpoint)
        config = run_config(checkpoint, args.config)
        load_builder(config["model"])
    generated = expand_files(args.generated, "--generated") if args.generated else None
    output = output_folder(args, checkpoint)
    if os.path.isfile(output):
        raise UsageError(f"--output {output} is a file, not a folder")
    if os.path.exists(output) and not args.overwrite:
        raise UsageError(f"--output {output} exists (give --overwrite to replace it)")
    return checkpoint, config, expand_files(args.mc, "--mc"), generated


def split_mc(count: int, events, seed: int = 0, covered: Optional[int] = None) -> np.ndarray:
    """The MC's event numbers, the compared half then the floor's (``physics.halves``), each
    sorted: a seeded permutation of the MC alone, so that the floor depends on the MC file,
    ``events`` and ``seed``, never on the generator (with --generated, the showers read are
    those at the compared half's event numbers; a generated file of ``covered`` < ``count``
    showers, made for the MC's first events, has the compared half drawn from those)."""
    half = count // 2 if events is None else min(events, count // 2)
    rng = np.random.default_rng(seed)
    if covered is not None and covered < count:
        half = min(half, covered)
        compared = rng.permutation(covered)[:half]
        rest = np.setdiff1d(np.arange(count), compared)
        return np.concatenate([np.sort(compared), np.sort(rng.permutation(rest)[:half])])
    picked = rng.permutation(count)
    if half == 0:
        return np.sort(picked[:1])
    return np.concatenate([np.sort(picked[:half]), np.sort(picked[half:2 * half])])


def output_folder(args, checkpoint) -> str:
    """--output, or RUN/validation/final with a checkpoint, or ./validation."""
    run = os.path.dirname(os.path.dirname(checkpoint)) if checkpoint else None
    return args.output or (os.path.join(run, "validation", "final") if run else "validation")


def _shower_format(paths, angle_key: str):
    """The preprocessing of files read without a model: the variant from the ECAL shape."""
    import h5py

    from .format import GEOMETRY, Preprocess

    with h5py.File(paths[0], "r") as f:
        shape = tuple(f["ECAL"].shape[1:]) if "ECAL" in f else None
    variant = next((v for v, g in GEOMETRY.items() if g["shape"] == shape), None)
    if variant is None:
        raise UsageError(f"{paths[0]}: dataset 'ECAL' has events of shape {shape}, expected "
                         f"one of {', '.join(str(g['shape']) for g in GEOMETRY.values())}")
    return SimpleNamespace(variant=variant, preprocess=Preprocess(variant, angle_key),
                           keys=["ECAL", "energy"] if variant == "angle" else ["ECAL"],
                           optional_keys=[angle_key] if variant == "angle" else ["energy", "target"])


def _open_files(task, paths, what: str, need_angle: bool = False):
    """Rank 0: the files as an event table, checked as the task checks training files."""
    from ..data.hdf5 import EventFiles
    from .gan import GANProtocol

    files = EventFiles(paths, task.keys, task.optional_keys)
    if isinstance(task, GANProtocol):
        task.check_files(files)
    elif task.variant == "fixed" and not {"energy", "target"} & files.optional_present:
        raise UsageError(f"{what} {paths[0]}: no dataset 'energy' (or 'target') with the "
                         "primary energy")
    angle_key = task.preprocess.angle_key
    if need_angle and task.variant == "angle" and angle_key not in files.optional_present:
        raise UsageError(f"{what} {paths[0]}: no dataset '{angle_key}': generated showers must "
                         "carry the angle they were generated for (or give --angle-key)")
    return files


def _share(comm, files):
    from ..data.hdf5 import EventFiles

    shared = comm.bcast(None if files is None else
                        (files.paths, files.counts, sorted(files.optional_present), files.keys))
    return EventFiles.from_counts(*shared[:3], keys=shared[3])


def main(argv=None) -> int:
    p = RankZeroArgumentParser(prog="python -m mpilearn.validate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="checkpoint file, its 'latest' pointer, or a run directory")
    p.add_argument("--generated", nargs="+", help="showers to compare instead of generating "
                   "them: HDF5 files or globs in the MC's format, paired with the MC by (E, θ)")
    p.add_argument("--mc", nargs="+", required=True, help="Monte Carlo HDF5 files or globs")
    p.add_argument("--config", help="the run's config.yaml (default: next to checkpoints/)")
    p.add_argument("--angle-key", default="mtheta", help="the angle dataset of files read "
                   "without a checkpoint (default mtheta)")
    p.add_argument("--events", type=int, default=None, help="MC events to compare (default: "
                   "half of every MC event); as many again, disjoint, give the MC-vs-MC floor "
                   "(with fewer MC events, the two halves of what there is)")
    p.add_argument("--seed", type=int, default=0, help="the seed of the MC's split into the "
                   "compared half and the floor's half (default 0): the same MC, --events and "
                   "--seed give the same floor, whatever is compared with it")
    p.add_argument("--output", default=None, help="folder for validation.json and plots "
                   "(default: RUN/validation/final, or ./validation without a checkpoint)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output folder")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-classifier", action="store_true", help="skip the classifier AUC")
    p.add_argument("--voxel-events", type=int, default=256, help="events of each sample for "
                   "the low-level (voxel) classifier AUC (default 256: minutes on a CPU; 0 skips it)")
    p.add_argument("--full", action="store_true", help="the voxel classifier on every compared "
                   "event, on the GPU where there is one")
    p.add_argument("--seeds", type=int, default=5, help="classifier runs (splits and "
                   "initialisations) averaged for the AUC (default 5)")
    args = p.parse_args(argv)

    from ..core import comm as mcomm
    from .runs import load_task

    ctx = mcomm.init()
    try:
        checkpoint, config, mc_paths, gen_paths = ctx.comm.bcast(
            check_on_root(ctx.comm, prepare, args), root=0)
        task, epoch = (load_task(checkpoint, config) if checkpoint
                       else (_shower_format(mc_paths, args.angle_key), None))
        mc, generated = check_on_root(ctx.comm, lambda: (
            _open_files(task, mc_paths, "MC"),
            gen_paths and _open_files(task, gen_paths, "generated", need_angle=True))) or (None, None)
        mc = _share(ctx.comm, mc)
        generated = _share(ctx.comm, generated) if gen_paths else None
        run = os.path.dirname(os.path.dirname(checkpoint)) if checkpoint else None
        output = output_folder(args, checkpoint)
        if ctx.rank == 0 and args.overwrite and os.path.isdir(output):
            import glob

            # asked for: the earlier validation's own files go (no stale plot stays beside the
            # new ones), nothing else the folder holds
            for old in glob.glob(os.path.join(output, "*.png")) + [
                    os.path.join(output, "validation.json")]:
                if os.path.isfile(old):
                    os.remove(old)
        events = split_mc(len(mc), args.events, args.seed,
                          len(generated) if generated is not None else None)
        title = " ".join(filter(None, [
            f"run {os.path.basename(os.path.abspath(run))}" if run else None,
            epoch,
            f"generated {os.path.basename(gen_paths[0])}" if gen_paths else None]))
        from .physics import validate_task

        result = validate_task(task, mc, events, ctx.comm, output, max_events=len(events),
                               plots=not args.no_plots, generated=generated, title=title,
                               classifier=not args.no_classifier, seeds=args.seeds,
                               voxel_events=0 if args.no_classifier else
                               (len(events) // 2 if args.full else args.voxel_events),
                               device=_device(args.full))
    except Exception as err:  # mpilearn's own errors become statuses; others abort the job
        return exit_status(err, ctx.rank)
    if ctx.rank == 0:
        if args.json:
            from ..core.io import atomic_write_text

            atomic_write_text(args.json, json.dumps(result, indent=2))
        print(summary(result) + f"; results in {args.json or output}")
        print("\n".join(verdicts(result)))
    return 0


def _device(full: bool) -> str:
    """The voxel classifier's device: the GPU with --full where there is one."""
    if not full:
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def summary(result: dict) -> str:
    """One line: the project's score, the reference metric and the sampling-fraction MRE."""
    def terms(prefix):
        return ", ".join(f"{k} {result[prefix + k]:.4f}" for k in ("moments", "profiles", "angle")
                         if prefix + k in result)

    from .callbacks import beside
    from .physics import SIGMA

    if not result.get("events"):
        return "no MC event passed the selection"

    def floor(name):
        if result.get(f"{name}_floor") is None:
            return ""
        if name in SIGMA:   # a floor 0 within its error: the distance from it in σ
            return f" ({beside(result, name) or 'σ n/a; MC floor ' + format(result[name + '_floor'], '.4g')})"
        ratio = result.get(f"{name}_ratio")
        return (f" [MC-vs-MC floor {result[name + '_floor']:.4g}, "
                + (f"{ratio:.3g}x floor]" if ratio is not None else "ratio n/a]"))

    def challenge():
        out = []
        for name in ("fpd", "kpd", "separation_power", "auc_high", "auc_low"):
            if result.get(name) is None:
                continue
            err = result.get(f"{name}_error")
            out.append(f"{name} {result[name]:.4g}" + (f" ± {err:.2g}" if err is not None else "")
                       + floor(name))
        return "; ".join(out)

    return (f"score {result['score']:.4f}{floor('score')} ({terms('')}); reference_metric "
            f"{result['reference_metric']:.4f} ({terms('reference_')}), over the cells the MC "
            f"fills {result['reference_metric_filled']:.4f}{floor('reference_metric_filled')}; "
            f"sampling_fraction_mre {result['sampling_fraction_mre']:.4f} ± "
            f"{result['sampling_fraction_mre_error']:.4f}{floor('sampling_fraction_mre')}; "
            f"{challenge()} on {result['events']} events")


FAMILIES = (("the project's score", ("score",)),
            ("the reference's numbers", ("reference_metric_filled", "sampling_fraction_mre")),
            ("the CaloChallenge distances", ("fpd", "kpd", "separation_power")),
            ("the CaloChallenge classifiers", ("auc_high", "auc_low")))


# a distance this many σ above its floor (FPD, KPD) is told from the MC
FLAGGED_SIGMA = 3.0


def sigma_verdict(result: dict, name: str) -> str:
    """FPD's or KPD's distance from a floor 0 within its error, in words."""
    from .callbacks import plus_minus, sigmas

    sigma = result.get(name + "_sigma")
    if sigma is None:
        return ""
    floor = plus_minus(result[name + "_floor"], result.get(name + "_floor_error"))
    if sigma < FLAGGED_SIGMA:
        return f"at the MC floor ({sigmas(sigma)} from {floor})"
    return f"{sigmas(sigma)} above the MC floor {floor}" + (" (far off)" if sigma > 100 else "")


def verdicts(result: dict) -> list:
    """A short verdict per metric family, in the metric's own terms: "at the MC floor" where a
    number is within the floor's noise (MC against MC is), else how many times the floor, or
    for FPD and KPD (a floor 0 within its error) how many σ above it."""
    from ..train.page import verdict
    from .physics import SIGMA
    from .published import place, reference_lines

    if not result.get("events"):
        return []
    lines = ["verdict (lower is better; 1x the MC floor = as good as the simulation; FPD and "
             f"KPD: told from the MC at >= {FLAGGED_SIGMA:g} σ above their floor):"]
    published = []
    for family, names in FAMILIES:
        shown = [name for name in names if result.get(name) is not None
                 and result.get(name + "_floor") is not None]
        parts = [f"{name} " + ", ".join(filter(None, [
                     sigma_verdict(result, name) if name in SIGMA else
                     verdict(result.get(name + "_ratio"), name, result[name],
                             result.get(name + "_floor")),
                     place(name, result[name])])) for name in shown]
        if parts:
            lines.append(f"  {family}: " + "; ".join(parts))
        published += shown
    return lines + [f"  {line}" for line in reference_lines(published)]


if __name__ == "__main__":
    sys.exit(main())
