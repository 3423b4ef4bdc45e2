"""Plan, then build: every check the training driver makes, in one step, before it constructs
anything.

Rank 0 checks in the order a user would fix things: the run directory, the loggers, the model
file and its hyperparameters, the model itself (rank 0 builds it), the data, the strategy's
rank count, one global batch, the monitored metrics, every rank's device, one batch through
the model, the checkpoint to resume. The first mistake is the one message (a UsageError on
every rank: exit 2, printed once). What only another rank can tell (its device) is gathered
first. ``engine.Trainer`` then builds from the :class:`Plan` and checks nothing more.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional

from ..core import comm as mcomm
from ..core.builders import load_builder
from ..core.comm import fail_usage
from ..data.hdf5 import ShardedLoader
from ..errors import UsageError
from .scaling import Scaling
from . import checkpoint as ckpt, elastic
from . import loggers, resize
from .checks import (check_framework, check_hparams, check_monitor, check_output,
                     check_precision, check_run_dir, check_watchdog, choose_device, default_output, dry_run,
                     open_files)
from .setup import counted, event_split, new_task
from .strategies import make_strategy


@dataclass
class Plan:
    output: str
    notes: list         # rank 0's lines, printed before training (accepted changes, resume)
    files: list         # (train, validation, test) counts (setup.counted), None where not given
    events: tuple       # (train, validation) event indices
    monitors: dict      # check_monitor's: (metric, mode) or None per section
    checkpoint: Optional[tuple] = None  # --resume: (path, state); None: start fresh
    fresh: str = ""     # --resume auto found no checkpoint: the line saying so (the driver
                        # prints it; an HPO fold, where starting fresh is the rule, does not)
    device: str = "cpu"  # this rank's
    task: object = None  # rank 0's, built for the checks (the others build theirs)
    batch_size: int = 0  # the per-rank batch in force (train.elastic.batch at a size change)


def make(config: dict, ctx, output: Optional[str] = None, resume=False,
         events: Optional[tuple] = None, overwrite: bool = False, force: bool = False) -> Plan:
    """Collective: the checked plan on every rank, or the first mistake as a UsageError on
    every rank. Arguments as ``engine.Trainer``'s."""
    comm = ctx.comm
    # TensorFlow sizes its thread pools when it starts (maybe inside the model file)
    for var in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        os.environ.setdefault(var, str(mcomm.threads_per_rank(ctx)))
    device, problem = choose_device(ctx, config)
    problems = comm.gather(problem, root=0)
    plan, message = None, None
    if ctx.rank == 0:
        try:
            plan = _check(config, ctx, output, resume, events, overwrite, force, problems)
        except UsageError as err:
            message = str(err)
    fail_usage(comm, message)
    shared = comm.bcast(replace(plan, task=None) if ctx.rank == 0 else None, root=0)
    return replace(shared, device=device, task=plan.task if ctx.rank == 0 else None)


def _check(config, ctx, output, resume, events, overwrite, force, device_problems) -> Plan:
    """Rank 0: every check, in order; raises the first UsageError."""
    train = config["train"]
    output = output or config["output"] or default_output(config)
    check_output(output)
    notes = list(check_run_dir(output, config, resume, overwrite, force))
    loggers.check(train["log"])
    check_watchdog(train["watchdog"])

    load_builder(config["model"])  # a missing file or function, before its hyperparameters
    check_hparams(config["model"], config["hparams"])
    task = new_task(config)
    check_precision(task, train["precision"])
    check_framework(task, train)
    elastic.check(config, ctx.size)

    files = open_files(config, task)
    for f in files:
        if f is not None:
            f.on_error = config["data"]["on_error"]
    split = event_split(config, files[0], files[1], events)
    strategy = make_strategy(train, ctx.comm)
    if ctx.size < strategy.min_ranks:
        raise UsageError(f"train.algorithm={train['algorithm']} needs at least "
                         f"{strategy.min_ranks} ranks (rank 0 is the master, the others train)")
    # too few events for one global batch? (the loader says so)
    ShardedLoader(files[0], split[0], train["batch_size"], *strategy.shard(0, ctx.size))
    monitors = check_monitor(config, task, len(split[1]) > 0)

    problem = next((p for p in device_problems if p), None)
    if problem:
        raise UsageError(problem)
    dry_run(task, files[0], split[0])
    folder = os.path.join(output, "checkpoints")
    checkpoint = _checkpoint(folder, resume, notes) if resume else None
    fresh = f"mpilearn: no checkpoint in {folder}; starting fresh" \
        if resume and checkpoint is None else ""
    # the batch policy at another rank count than the checkpoint's (resize.py)
    shards = strategy.shard(0, ctx.size)[1]
    saved = resize.saved_batches(checkpoint[1], train["batch_size"]) if checkpoint else None
    batch = resize.local_batch(train, shards, saved)
    if batch != train["batch_size"]:
        ShardedLoader(files[0], split[0], batch, 0, shards)
    Scaling(train, task).check(shards, batch)  # srsr's bound at this global batch
    return Plan(output, notes, counted(files), split, monitors, checkpoint, fresh, task=task,
                batch_size=batch)


def _checkpoint(folder: str, resume, notes: list) -> Optional[tuple]:
    """``--resume``: (path, state) of the newest checkpoint that loads, None to start fresh
    (``--resume auto`` only); the ones that do not load are noted."""
    path, state, failed = ckpt.load_newest(folder)
    notes += [f"mpilearn: checkpoint {bad} does not load ({why}); trying an older one"
              for bad, why in failed]
    if path is not None:
        return path, state
    if failed:
        raise UsageError(f"--resume: no checkpoint in {folder} loads: "
                         + "; ".join(f"{p}: {why}" for p, why in failed))
    if resume != "auto":
        raise UsageError(f"--resume: no checkpoint in {folder} (use --resume auto to start "
                         "fresh when there is none)")
    return None
