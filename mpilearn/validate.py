"""python -m mpilearn.validate: physics validation of a trained 3DGAN against Monte Carlo.

    python -m mpilearn.validate --checkpoint runs/demo/checkpoints/latest --mc data/*.h5
    mpirun -np 4 python -m mpilearn.validate --checkpoint ... --mc ... --events 5000

For every MC event, one shower is generated with the same (E, θ); the §4b observables
(sampling fraction, x/y/z shapes, moments, position of the maximum, cell spectrum, hits,
longitudinal ratios, measured angle) are compared and scored (see ``mpilearn.physics``).
Writes ``validation.json`` and PNG plots into ``--output``.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from .launcher import RankZeroArgumentParser
from .comm import UsageError, check_on_root


def _resolve_checkpoint(path: str) -> str:
    from .train import checkpoint as ckpt

    if os.path.isdir(path):
        found = ckpt.latest(path) or ckpt.latest(os.path.join(path, "checkpoints"))
        if not found:
            raise UsageError(f"no checkpoint in {path}")
        return found
    if os.path.basename(path) == ckpt.LATEST:
        found = ckpt.latest(os.path.dirname(path))
        if not found:
            raise UsageError(f"{path} points to no existing checkpoint")
        return found
    if not os.path.isfile(path):
        raise UsageError(f"checkpoint not found: {path}")
    return path


def _run_config(checkpoint: str, config: str = None) -> dict:
    import yaml

    path = config or os.path.join(os.path.dirname(os.path.dirname(checkpoint)), "config.yaml")
    if not os.path.isfile(path):
        raise UsageError(f"run config not found: {path} (give it with --config)")
    with open(path) as f:
        return yaml.safe_load(f)


def prepare(args):
    """Rank 0: check every input before anything is built or read."""
    from .data.hdf5 import EventFiles
    from .builders import load_builder
    from .train.engine import expand_files

    checkpoint = _resolve_checkpoint(args.checkpoint)
    config = _run_config(checkpoint, args.config)
    load_builder(config["model"])
    return checkpoint, config, expand_files(args.mc)


def main(argv=None) -> int:
    p = RankZeroArgumentParser(prog="python -m mpilearn.validate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint file, its 'latest' pointer, or a run directory")
    p.add_argument("--mc", nargs="+", required=True, help="Monte Carlo HDF5 files or globs")
    p.add_argument("--config", help="the run's config.yaml (default: next to checkpoints/)")
    p.add_argument("--events", type=int, default=2000, help="MC events to compare (default 2000)")
    p.add_argument("--output", default=None, help="folder for validation.json and plots "
                   "(default: RUN/validation/final)")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)

    from . import comm as mcomm

    ctx = mcomm.init()
    try:
        checkpoint, config, files = ctx.comm.bcast(check_on_root(ctx.comm, prepare, args), root=0)
        from .data.hdf5 import EventFiles
        from .builders import load_builder
        from .train import checkpoint as ckpt

        task = load_builder(config["model"])(dict(config.get("hparams") or {}))
        if not hasattr(task, "generate"):
            raise UsageError(f"model {config['model']} is not a generative (GAN) task")
        mc = check_on_root(ctx.comm, lambda: _check_mc(task, files))
        mc = ctx.comm.bcast(None if mc is None else (mc.paths, mc.counts, sorted(mc.optional_present)))
        mc = EventFiles.from_counts(*mc, keys=task.keys)
        state = ckpt.load(checkpoint)
        task.device = "cpu"
        task.load_state_dict(state["task"])
        output = args.output or os.path.join(os.path.dirname(os.path.dirname(checkpoint)),
                                             "validation", "final")
        from .physics import validate_task

        events = np.random.default_rng(0).permutation(len(mc))[:args.events]
        result = validate_task(task, mc, np.sort(events), ctx.comm, output,
                               max_events=args.events, plots=not args.no_plots)
    except UsageError as err:
        if ctx.rank == 0:
            sys.stderr.write(f"mpilearn: error: {err}\n")
        return 2
    if ctx.rank == 0:
        print(f"score {result['score']:.4f} (moments {result.get('moments', 0):.4f}, profiles "
              f"{result.get('profiles', 0):.4f}, angle {result.get('angle', 0):.4f}) on "
              f"{result['events']} events; results in {output}")
    return 0


def _check_mc(task, files):
    from .data.hdf5 import EventFiles

    mc = EventFiles(files, task.keys, task.optional_keys)
    task.check_files(mc)
    return mc


if __name__ == "__main__":
    sys.exit(main())
