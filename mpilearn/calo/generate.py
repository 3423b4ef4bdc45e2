"""python -m mpilearn.generate: showers from a trained 3DGAN, in the calorimeter's HDF5 format.

    python -m mpilearn.generate runs/gan --events 10000 --output showers.h5
    python -m mpilearn.generate runs/gan --events 5000 --energy 10 500 --energy-dist log \\
        --angle 60 120 --output showers.h5
    mpirun -np 4 python -m mpilearn.generate --checkpoint runs/gan/checkpoints/best.pt \\
        --conditions mc.h5 --output fast.h5 --precision bf16

The generator comes from a run directory (its ``checkpoints/best.pt`` when there is one, else the
latest checkpoint) or ``--checkpoint``; PyTorch and Keras runs alike. Conditions: ``--energy``
(GeV) and ``--angle`` (degrees, the angle model only) take one value, a list (event i takes
value i mod n) or, with ``--*-dist uniform|log``, a range of two values (two values default
to a uniform range); or ``--conditions`` reads them from HDF5 (``energy`` in GeV and the run's
angle key in rad, as the calorimeter files) or CSV (columns ``energy`` in GeV and ``angle`` in
degrees). The output holds ``ECAL`` (GeV x 50 for the angle model, GeV for the fixed one),
``energy`` and the angle under the run's angle key: what the loader and ``validate
--generated`` read.

Reproducible whatever the rank count: event i's noise (and drawn conditions) depend only on
(--seed, i), and events go in batches of fixed global ranges, batch k to rank k mod ranks;
rank 0 gathers the batches in order and writes one file.

Conditions outside the run's training ranges (``RUN/training_ranges.json``, recorded when
training started; ``mpilearn.calo.ranges``) are refused with exit 2 naming the range, and an
angle that looks like radians is named as such; ``--extrapolate`` generates there with one
warning.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

from ..core.comm import check_on_root
from ..core.cpu import EMULATED_BF16_COST, emulated
from ..errors import UsageError, exit_status
from ..cluster.launcher import RankZeroArgumentParser
from . import ranges

# .format and .runs import torch: they are imported where used, so that --help stays quick

CONDITION_KEY = 2  # the per-event RNG purpose of drawn conditions (training 0, noise 1)


def _spec(values, dist, name, low, high):
    """(values, distribution) checked: a list, or a uniform/log range of two values."""
    dist = dist or ("uniform" if len(values) == 2 else "list")
    bad = [v for v in values if not (low < v < high)]
    if bad:
        raise UsageError(f"--{name} {bad[0]:g} is out of range ({low:g}, {high:g})")
    if dist != "list" and (len(values) != 2 or values[0] >= values[1]):
        raise UsageError(f"--{name}-dist {dist} needs two values LOW HIGH with LOW < HIGH, got "
                         f"{' '.join(f'{v:g}' for v in values)}")
    return np.asarray(values, np.float64), dist


def _pick(spec, u, index):
    values, dist = spec
    if dist == "list":
        return values[index % len(values)]
    lo, hi = values
    return lo + u * (hi - lo) if dist == "uniform" else lo * (hi / lo) ** u


def drawn_conditions(energy, angle, seed: int, index: np.ndarray):
    """Energies (GeV) and angles (rad) of events ``index``, each from (seed, event) only."""
    u = np.array([np.random.default_rng([seed, CONDITION_KEY, int(i)]).random(2) for i in index])
    u = u.reshape(len(index), 2)
    e = _pick(energy, u[:, 0], index)
    a = np.radians(_pick(angle, u[:, 1], index)) if angle is not None else None
    return e, a


def read_conditions(path: str, angle_key, events):
    """(energy GeV, angle rad or None) from an HDF5 or CSV file, checked."""
    if not os.path.isfile(path):
        raise UsageError(f"--conditions {path}: no such file")
    if path.lower().endswith(".csv"):
        import csv

        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        need = ["energy"] + (["angle"] if angle_key else [])
        missing = [k for k in need if not rows or k not in rows[0]]
        if missing:
            raise UsageError(f"--conditions {path}: no column '{missing[0]}' (need {', '.join(need)})")
        try:
            table = {k: np.array([float(r[k]) for r in rows]) for k in need}
        except ValueError as err:
            raise UsageError(f"--conditions {path}: {err}") from None
        energy, angle = table["energy"], np.radians(table["angle"]) if angle_key else None
    else:
        import h5py

        try:
            with h5py.File(path, "r") as f:
                for key in ["energy"] + ([angle_key] if angle_key else []):
                    if key not in f:
                        raise UsageError(f"--conditions {path}: no dataset '{key}'")
                energy = np.asarray(f["energy"], np.float64).reshape(-1)
                angle = np.asarray(f[angle_key], np.float64).reshape(-1) if angle_key else None
        except OSError as err:
            raise UsageError(f"--conditions {path}: not an HDF5 or CSV file ({err})") from None
    n = len(energy) if events is None else events
    if n > len(energy) or n < 1:
        raise UsageError(f"--conditions {path} has {len(energy)} event(s), --events asks for {n}")
    for name, values in (("energy", energy[:n]), ("angle", None if angle is None else angle[:n])):
        bad = np.nonzero(~np.isfinite(values) | (values <= 0))[0] if values is not None else []
        if len(bad):
            raise UsageError(f"--conditions {path}: {name} of event {bad[0]} is "
                             f"{float(values[bad[0]])!r}, not a positive number")
    return energy[:n], None if angle is None else angle[:n]


def prepare(args):
    """Rank 0, before any model is built: the arguments, the checkpoint, the output."""
    import torch

    from .runs import resolve_checkpoint, run_config

    if args.runtime == "onnx" and not args.run:
        raise UsageError("--runtime onnx: give the exported .onnx file (python -m mpilearn.export "
                         "writes it) as the first argument")
    if not (args.run or args.checkpoint):
        raise UsageError("give a run directory or --checkpoint")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads {args.threads}: must be at least 1")
    if args.runtime == "onnx":
        args.onnx_file, args.run = args.run, None
        args.checkpoint = args.checkpoint or onnx_checkpoint(args.onnx_file)
        try:
            import onnxruntime  # noqa: F401
        except ImportError as err:
            raise UsageError(f"--runtime onnx: running {args.onnx_file} needs ONNX Runtime, which "
                             f"does not import here ({err}; pip install onnxruntime)") from None
    if args.events is not None and args.events < 1:
        raise UsageError(f"--events {args.events}: must be at least 1")
    if args.gate_events < 2:
        raise UsageError(f"--gate-events {args.gate_events}: must be at least 2")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size}: must be at least 1")
    if args.conditions is None and args.events is None:
        raise UsageError("give --events (or --conditions with the events' energies and angles)")
    energy = _spec(args.energy, args.energy_dist, "energy", 0.0, math.inf)
    angle = _spec(args.angle, args.angle_dist, "angle", 0.0, 180.0)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: no CUDA device here")
    if os.path.isdir(args.output):
        raise UsageError(f"--output {args.output} is a folder, not a file")
    if os.path.exists(args.output) and not args.overwrite:
        raise UsageError(f"--output {args.output} exists (give --overwrite to replace it)")
    checkpoint = resolve_checkpoint(args.checkpoint or args.run, prefer_best=True)
    config = run_config(checkpoint, args.config)
    from ..core.builders import load_builder

    load_builder(config["model"])
    run = os.path.dirname(os.path.dirname(checkpoint))
    trained = ranges.read(run)
    if args.conditions is None:  # the values asked for (a range's ends)
        ranges.check(trained, energy[0], angle[0] if args.angle_given else None,
                     args.extrapolate, f"run {run}")
    return SimpleNamespace(checkpoint=checkpoint, config=config, energy=energy, angle=angle,
                           ranges=trained, run=run)


def onnx_checkpoint(path) -> str:
    """The checkpoint an exported file was made from (its metadata): the run's conditions,
    ranges and noise come from there, the showers from the file."""
    if not path or not os.path.isfile(path):
        raise UsageError(f"--runtime onnx: {path} is not a file (give the exported .onnx file)")
    try:
        import onnx
    except ImportError as err:
        raise UsageError(f"--runtime onnx: reading {path}'s metadata needs the onnx package, which "
                         f"does not import here ({err}; pip install onnx)") from None
    try:
        props = {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}
    except Exception as err:
        raise UsageError(f"--runtime onnx: {path} is not an ONNX file ({err})") from None
    if not props.get("checkpoint"):
        raise UsageError(f"--runtime onnx: {path} has no 'checkpoint' in its metadata "
                         "(export it with python -m mpilearn.export, or give --checkpoint)")
    return props["checkpoint"]


def onnx_model(path: str, variant: str, threads: int = 0):
    """A callable like ``ShowerModel`` on numpy arrays, running ``path`` in ONNX Runtime (CPU)
    with ``threads`` intra-op threads (0: ONNX Runtime's default)."""
    from .export import NAMES
    from .precision import session

    try:
        sess = session(path, threads)
    except Exception as err:  # alike on every rank: the same file
        raise UsageError(f"--runtime onnx: ONNX Runtime could not load {path}: {err}") from None
    names = NAMES[variant]
    return lambda *inputs: sess.run(None, {k: np.asarray(v, np.float32)
                                           for k, v in zip(names, inputs)})[0]


# showers from which --precision auto takes int8-fast on the CPU: its calibration and physics
# gate cost ~3 x --gate-events fp32 showers, which int8-fast's ~2.5x speed-up over fp32-fast
# (docs/benchmarks/fastsim.md) pays back at ~500; four times that, so that it clearly pays
AUTO_INT8_EVENTS = 2000


def auto_precision(task, device: str, events: int, runtime: str = "torch") -> str:
    """--precision auto: the fastest variant behind a physics gate for this run and device
    (--runtime onnx: the file's own, fp32 as far as PyTorch is concerned)."""
    from .runs import is_keras

    if is_keras(task) or not device.startswith("cpu") or runtime == "onnx":
        return "fp32"
    return "int8-fast" if events >= AUTO_INT8_EVENTS else "fp32-fast"


def plan_conditions(args, plan, task):
    """Rank 0, with the model: the conditions the variant takes, read or described."""
    from .runs import is_keras

    angle_key = task.preprocess.angle_key if task.variant == "angle" else None
    if args.precision not in ("fp32", "auto") and is_keras(task):
        raise UsageError(f"--precision {args.precision} needs a PyTorch run (Keras: fp32)")
    if args.precision == "int8-fast" and not args.device.startswith("cpu"):
        raise UsageError(f"--precision int8-fast runs on the CPU (oneDNN), not --device {args.device}")
    if args.angle_given and task.variant != "angle":
        raise UsageError("--angle: the fixed-angle (25x25x25) model takes no angle")
    if args.conditions:
        energy, angle = read_conditions(args.conditions, angle_key, args.events)
        ranges.check(plan.ranges, energy, None if angle is None else np.degrees(angle),
                     args.extrapolate, f"--conditions {args.conditions}: run {plan.run}")
        return energy, angle
    return None


def int8_model(task, plan):
    """The int8-fast ShowerModel, calibrated on the run's training ranges (seeded: the same
    model on every rank)."""
    from .fastpath import Chunked
    from .int8fast import int8_shower_model
    from .runs import shower_model

    trained = plan.ranges or {}
    meta = {"variant": task.variant, "energy_range_gev": trained.get("energy_gev"),
            "angle_range_deg": trained.get("angle_deg")}
    return Chunked(int8_shower_model(shower_model(task), meta)), meta


def gate_int8(args, task, model, meta):
    """Rank 0: int8-fast's physics gate against the fp32 generator; UsageError when it fails
    (a warning with --force)."""
    from . import precision
    from .export import latent
    from .runs import shower_model

    fp32 = shower_model(task)
    result = precision.gate(fp32, model, meta, latent(fp32), events=args.gate_events)
    numbers = precision.describe(result)
    if not result["passed"] and not args.force:
        raise UsageError(f"--precision int8-fast refused: its physics moved by more than the fp32 "
                         f"generator's own seed-to-seed spread: {numbers} (give --force to use it "
                         "anyway)")
    print(("mpilearn: warning: int8-fast used with --force although its physics gate failed: "
           if not result["passed"] else "int8-fast physics gate passed: ") + numbers,
          file=sys.stderr if not result["passed"] else sys.stdout, flush=True)


def produce(task, plan, table, args, comm, write=None, model=None):
    """Collective: every rank generates batches k = rank, rank + ranks, ...; rank 0 gathers
    each round in order and calls ``write(start, energy, angle, cells_gev)``. ``model``: a
    ShowerModel built beforehand (int8-fast), else the task's."""
    import torch

    from .runs import is_keras, shower_model

    rank, size = comm.Get_rank(), comm.Get_size()
    n = len(table[0]) if table is not None else args.events
    batches = math.ceil(n / args.batch_size)
    onnx = None
    if getattr(args, "runtime", "torch") == "onnx":
        onnx = onnx_model(args.onnx_file, task.variant, getattr(args, "threads", None) or 0)
    elif model is None and not is_keras(task):  # PyTorch: the exported module, on the device
        model = shower_model(task)
        if args.precision.endswith("-fast"):
            from .fastpath import Chunked, fast_shower_model

            model = Chunked(fast_shower_model(model, args.precision))
        model = model.to(args.device)
    autocast = torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16,
                              enabled=args.precision == "bf16")
    bar = None
    if rank == 0 and args.progress:
        from tqdm import tqdm

        bar = tqdm(total=n, desc="generating", unit="shower", file=sys.stderr)
    for first in range(0, batches, size):
        k = first + rank
        index = np.arange(k * args.batch_size, min(n, (k + 1) * args.batch_size)) if k < batches \
            else np.arange(0)
        if table is not None:
            e, a = table[0][index], None if table[1] is None else table[1][index]
        else:
            e, a = drawn_conditions(plan.energy, plan.angle if task.variant == "angle" else None,
                                    args.seed, index)
        cells = None
        if len(index) and onnx is not None:
            cells = onnx(task.generation_noise(index), e / 100.0,
                         *(() if a is None else (a,)))
        elif len(index) and model is not None:
            t = lambda x: torch.as_tensor(np.asarray(x, np.float32), device=args.device)  # noqa: E731
            with torch.inference_mode(), autocast:
                cells = model(t(task.generation_noise(index)), t(e / 100.0),
                              None if a is None else t(a)).cpu().numpy()
        elif len(index):
            cells = task.preprocess.to_gev(task.generate(e / 100.0, a, index)).astype(np.float32)
        parts = comm.gather((index, e, a, cells), root=0)
        if rank == 0:
            for index, e, a, cells in parts:
                if len(index):
                    write(int(index[0]), e, a, cells)
                    if bar is not None:
                        bar.update(len(index))
    if bar is not None:
        bar.close()
    return n


class _Writer:
    """Datasets for ``n`` events in ``h5``; called as write(start, energy, angle, cells_gev).
    Counts the empty showers: a cell sum at or below the preprocessing's cut, which
    ``validate`` drops before scoring."""

    def __init__(self, h5, task, n: int, compress: bool = True):
        from .format import GEOMETRY

        g = GEOMETRY[task.variant]
        self.unit, self.min_sum, self.empty = g["unit"], g["min_sum"], 0
        opts = {"compression": "gzip", "compression_opts": 1} if compress else {}
        self.ecal = h5.create_dataset("ECAL", (n, *g["shape"]), "float32", chunks=(1, *g["shape"]), **opts)
        self.energy = h5.create_dataset("energy", (n,), "float32")
        self.angle = h5.create_dataset(task.preprocess.angle_key, (n,), "float32") \
            if task.variant == "angle" else None

    def __call__(self, start, e, a, cells):
        stop = start + len(e)
        cells = cells * self.unit
        self.ecal[start:stop] = cells
        self.empty += int(np.sum(cells.reshape(len(cells), -1).sum(1) <= self.min_sum))
        self.energy[start:stop] = e
        if self.angle is not None:
            self.angle[start:stop] = a

    def warning(self, n: int):
        """A line for rank 0 when showers are empty, else None."""
        if not self.empty:
            return None
        return (f"mpilearn: warning: {self.empty} of {n} showers ({self.empty / n:.0%}) are empty "
                f"(cell sum <= {self.min_sum / self.unit:g} GeV), and validate scores only the "
                "others. A generator early in training can do this (generation uses its batch "
                "norm's running statistics, which warm up over the first few hundred steps); "
                "a trained one that does has collapsed.")


def main(argv=None) -> int:
    p = RankZeroArgumentParser(prog="python -m mpilearn.generate", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", nargs="?", help="run directory (its best, else latest, checkpoint)")
    p.add_argument("--checkpoint", help="checkpoint file (e.g. checkpoints/best.pt), 'latest' pointer or folder")
    p.add_argument("--config", help="the run's config.yaml (default: next to checkpoints/)")
    p.add_argument("--output", required=True, help="HDF5 file to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.add_argument("--events", type=int, help="showers to generate")
    p.add_argument("--energy", type=float, nargs="+", default=[100.0, 200.0],
                   help="GeV: a value, a list, or LOW HIGH (default 100 200)")
    p.add_argument("--energy-dist", choices=("list", "uniform", "log"))
    p.add_argument("--angle", type=float, nargs="+", default=None,
                   help="degrees: a value, a list, or LOW HIGH (default 60 120)")
    p.add_argument("--angle-dist", choices=("list", "uniform"))
    p.add_argument("--conditions", help="HDF5 or CSV file of the events' energies and angles")
    p.add_argument("--extrapolate", action="store_true", help="generate outside the run's "
                   "training ranges (RUN/training_ranges.json) with one warning, not exit 2")
    p.add_argument("--seed", type=int, default=0, help="noise and drawn conditions (default 0)")
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp32-fast", "bf16-fast",
                                           "int8-fast"),
                   default="auto", help="auto (default): on the CPU, int8-fast from "
                   f"{AUTO_INT8_EVENTS} showers on (where its gate pays back; fp32-fast if the "
                   "gate refuses it), else fp32-fast; on a GPU and for Keras runs, fp32. "
                   "bf16: autocast; fp32-fast / bf16-fast: the generator "
                   "rewritten for CPU inference (mpilearn.calo.fastpath; fp32-fast is the same "
                   "function); int8-fast: that rewrite with int8 convolutions (oneDNN, CPU), "
                   "calibrated on the run's training ranges and refused (exit 2) unless it "
                   "passes the physics gate against fp32 (mpilearn.calo.precision). PyTorch runs")
    p.add_argument("--gate-events", type=int, default=64,
                   help="showers per physics gate sample (int8-fast)")
    p.add_argument("--force", action="store_true",
                   help="generate with int8-fast although its physics gate fails (with a warning)")
    p.add_argument("--runtime", choices=("torch", "onnx"), default="torch",
                   help="onnx: the positional argument is an exported file (python -m "
                   "mpilearn.export; int8 included), run in ONNX Runtime on the CPU; its run "
                   "(conditions, ranges, noise) from the file's metadata")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is one)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads per rank: torch.set_num_threads(N) and, with --runtime "
                   "onnx, ONNX Runtime's intra-op threads (default: their own, all cores); on a "
                   "CPU shared with other work, 1")
    p.add_argument("--compression", choices=("gzip", "none"), default="gzip",
                   help="ECAL's compression (gzip level 1, as the simulated files; none: "
                   "faster writing where rank 0's writes limit the rate)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    from ..train.__main__ import add_force_unlock

    add_force_unlock(p)
    args = p.parse_args(argv)
    args.angle_given = args.angle is not None
    args.angle = args.angle or [60.0, 120.0]

    from ..core import comm as mcomm

    ctx = mcomm.init()
    try:
        import torch

        from .runs import load_task

        args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if args.device == "cuda" and torch.cuda.is_available():
            args.device = f"cuda:{ctx.local_rank % torch.cuda.device_count()}"
        onnx_file = args.run if args.runtime == "onnx" else None
        plan = ctx.comm.bcast(check_on_root(ctx.comm, prepare, args), root=0)
        args.onnx_file, args.run = onnx_file, None if onnx_file else args.run
        if args.threads:  # checked >= 1 in prepare
            torch.set_num_threads(args.threads)
        from ..core import runlock

        runlock.hold(ctx.comm, args.output, args.force_unlock, single_file=True)  # one writer
        task, epoch = load_task(plan.checkpoint, plan.config)
        task.seed = args.seed
        table = ctx.comm.bcast(check_on_root(ctx.comm, plan_conditions, args, plan, task), root=0)
        model = None
        auto = args.precision == "auto"
        if auto:
            n = len(table[0]) if table is not None else args.events
            args.precision = auto_precision(task, args.device, n, args.runtime)
        if args.precision == "int8-fast":
            model, meta = int8_model(task, plan)
            try:
                check_on_root(ctx.comm, gate_int8, args, task, model, meta)
            except UsageError as err:
                if not auto:
                    raise
                if ctx.rank == 0:  # auto falls back to the same function as fp32
                    print(f"mpilearn: {err}; --precision auto uses fp32-fast instead",
                          file=sys.stderr, flush=True)
                args.precision, model = "fp32-fast", None
        why = emulated(args.precision) if args.device == "cpu" else None
        if why and ctx.rank == 0:
            print(f"mpilearn: warning: --precision {args.precision} on {why}: "
                  f"{EMULATED_BF16_COST}; use --precision fp32-fast, int8-fast or auto",
                  file=sys.stderr, flush=True)
        ctx.comm.Barrier()
        start = time.perf_counter()
        if ctx.rank == 0:
            import h5py

            from ..core.io import atomic_write_bytes

            writer = None  # rank 0's, kept for its count of empty showers

            def write_all(f):
                nonlocal writer
                n = len(table[0]) if table is not None else args.events
                with h5py.File(f, "w") as h5:
                    h5.attrs.update({"checkpoint": plan.checkpoint, "seed": args.seed,
                                     "precision": args.precision, "runtime": args.runtime})
                    if args.onnx_file:
                        h5.attrs["onnx_file"] = os.path.abspath(args.onnx_file)
                    writer = _Writer(h5, task, n, args.compression == "gzip")
                    produce(task, plan, table, args, ctx.comm, writer, model)

            atomic_write_bytes(args.output, write_all)
        else:
            produce(task, plan, table, args, ctx.comm, model=model)
        seconds = time.perf_counter() - start
    except Exception as err:  # mpilearn's own errors become statuses; others abort the job
        return exit_status(err, ctx.rank)
    if ctx.rank == 0:
        n = len(table[0]) if table is not None else args.events
        if args.onnx_file:  # the showers came from the file; the checkpoint gave the run
            source, how = (f"{os.path.abspath(args.onnx_file)} in ONNX Runtime (--runtime onnx; "
                           f"exported from {plan.checkpoint}, {epoch})", "cpu, " + (
                               f"{args.threads} thread(s) per rank" if args.threads else
                               "ONNX Runtime's default threads"))
        else:
            source, how = f"{plan.checkpoint} ({epoch})", f"{args.device}, {args.precision}" \
                + (" (--precision auto)" if auto else "")
            if args.device == "cpu":
                how += f", {torch.get_num_threads()} thread(s) per rank"
        print(f"generated {n} showers from {source} on {ctx.size} rank(s), {how}: "
              f"{seconds:.1f} s, {n / seconds:.1f} showers/s (written to {args.output})", flush=True)
        warning = writer.warning(n)
        if warning:
            print(warning, file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
