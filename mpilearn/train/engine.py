"""The data-parallel training loop shared by every task and every launch context.

Order of work, so that bad input is reported before anything expensive starts:
config (already validated) -> model builder -> data files -> device -> weights broadcast ->
resume -> epochs. Everything takes the communicator it is given.
"""
from __future__ import annotations

import collections
import glob
import itertools
import math
import os
import sys
import time
from typing import Optional

import numpy as np
import torch

from .. import comm as mcomm
from .checks import (build_task, check_hparams, check_monitor, check_output, check_precision,
                     check_run_dir, clear_run_dir, describe_missing, dry_run, remove_stale_temp)
from ..comm import UsageError, check_on_root, fail_usage
from ..config import dump
from ..data.hdf5 import EventFiles, ShardedLoader, eval_batches, split_events
from .. import preempt
from ..io import append_jsonl, read_jsonl
from ..builders import load_builder
from . import asyncsgd
from . import checkpoint as ckpt
from . import loggers


def _raise(message: str):
    raise UsageError(message)


def expand_files(patterns) -> list:
    out = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) or [pattern]  # a literal name: 'not found' later
        for path in matches:
            why = describe_missing(path)
            if why:  # a directory, or a pattern that matched nothing
                raise UsageError(f"data file {why}")
        out.extend(matches)
    return out


def _open_files(config: dict, task) -> tuple:
    """Rank 0 only: check and count the data files; returns (train_files, val_files)."""
    data = config["data"]
    train = EventFiles(expand_files(data["files"]), task.keys, task.optional_keys)
    val = None
    if data["val_files"]:
        val = EventFiles(expand_files(data["val_files"]), task.keys, task.optional_keys)
    check = getattr(task, "check_files", None)
    for files in (train, val):
        if check and files is not None:
            check(files)
    return train, val


def _check_devices(ctx, config) -> str:
    """Every rank picks its device; any rank's problem is reported once by rank 0."""
    message, device = None, "cpu"
    per_task = mcomm.gpus_are_per_task(ctx)
    shared = config["device"]["allow_shared_gpus"] or mcomm.shared_gpus_from_env()
    try:
        device = mcomm.choose_device(ctx, config["device"]["type"], shared, per_task=per_task,
                                     backend=config["train"]["backend"])
    except UsageError as err:
        message = f"rank {ctx.rank}: {err}"
    messages = [m for m in ctx.comm.allgather(message) if m]
    fail_usage(ctx.comm, messages[0] if messages else None)
    return device


def default_output(config: dict) -> str:
    name = os.path.splitext(os.path.basename(config["model"].split(":")[0]))[0] or "run"
    return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


class Trainer:
    def __init__(self, config: dict, ctx, output: Optional[str] = None, resume=False,
                 progress: bool = True, events: Optional[tuple] = None,
                 deadline: Optional[float] = None, overwrite: bool = False,
                 force: bool = False):
        """``resume``: False, True (a checkpoint must exist) or "auto" (continue from one if
        there is one); ``events``: explicit (train, validation) event indices (HPO folds);
        ``deadline``: a time.time() after which training stops with TrainingStopped;
        ``overwrite``: replace an earlier run in ``output``; ``force``: resume although the
        config changed in what is trained."""
        self.config, self.ctx, self.resume = config, ctx, resume
        self.deadline, self.history = deadline, []
        self.on_epoch = None  # collective callback(record) -> True to stop (HPO schedulers)
        self.progress = progress and ctx.rank == 0
        comm = ctx.comm
        train = config["train"]

        # 0. the run directory, before anything is computed
        self.output = comm.bcast(output or config["output"] or default_output(config), root=0)
        check_on_root(comm, check_output, self.output)
        notes = check_on_root(comm, check_run_dir, self.output, config, resume, overwrite, force)
        for note in notes or ():
            print(note, flush=True)

        check_on_root(comm, loggers.check, train["log"])

        # 1. the model builder: a missing file or function, or an unknown hparam, is bad input
        check_on_root(comm, load_builder, config["model"])
        check_on_root(comm, check_hparams, config["model"], config["hparams"])
        # TensorFlow sizes its thread pools when it starts (maybe inside the model file)
        for var in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
            os.environ.setdefault(var, str(mcomm.threads_per_rank(ctx)))
        torch.manual_seed(train["seed"])
        np.random.seed(train["seed"])
        if train["deterministic"]:
            # cuBLAS is deterministic only with a fixed workspace, set before its first handle
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            # warn_only: on CUDA some ops have no deterministic kernel (the 3DGAN's 3-D average
            # pooling backward raised on an H100); they warn instead of ending the run
            torch.use_deterministic_algorithms(True, warn_only=True)
        # cuDNN picks the fastest convolution per input shape (the 3DGAN's shapes are fixed)
        torch.backends.cudnn.benchmark = not train["deterministic"]
        builder = load_builder(config["model"])
        if "keras" in sys.modules:  # the model file uses Keras: its initialisers too
            import keras

            keras.utils.set_random_seed(train["seed"])
        self.task = build_task(builder, config["model"], config["hparams"], comm)
        check_on_root(comm, check_precision, self.task, train["precision"])
        self.task.precision = train["precision"]

        # 2. the data files, counted once by rank 0
        files = check_on_root(comm, _open_files, config, self.task)
        meta = comm.bcast(None if files is None else
                          [(f.paths, f.counts, sorted(f.optional_present)) if f else None
                           for f in files], root=0)
        self.train_files, self.val_files = (
            EventFiles.from_counts(*m, keys=self.task.keys) if m else None for m in meta)
        for files in (self.train_files, self.val_files):
            if files is not None:
                files.on_error = config["data"]["on_error"]
        n = len(self.train_files)
        if events is not None:
            self.train_events, self.val_events = (np.asarray(e) for e in events)
        elif self.val_files is None and config["data"]["val_fraction"] > 0:
            self.train_events, self.val_events = split_events(
                n, config["data"]["val_fraction"], train["seed"])
        else:
            self.train_events = np.arange(n)
            self.val_events = np.arange(len(self.val_files)) if self.val_files else np.arange(0)
        self.val_source = self.val_files or self.train_files
        self.algorithm = train["algorithm"]
        if self.algorithm != "allreduce" and ctx.size < 2:
            check_on_root(comm, _raise, f"train.algorithm={self.algorithm} needs at least 2 ranks "
                                        "(rank 0 is the master, the others train)")
        check_on_root(comm, self._make_loader)  # too few events for one global batch?
        self.loader = self._make_loader()
        check_on_root(comm, check_monitor, config, self.task, len(self.val_events) > 0)

        # 3. output directory (rank 0 writes; stale temp files of killed writes go)
        self.ckpt_dir = os.path.join(self.output, "checkpoints")
        self.metrics_path = os.path.join(self.output, "metrics.jsonl")
        if ctx.rank == 0:
            if overwrite:
                clear_run_dir(self.output)
            os.makedirs(self.ckpt_dir, exist_ok=True)
            for path in remove_stale_temp([self.output, self.ckpt_dir]):
                print(f"mpilearn: removed {path}, left by an interrupted write", flush=True)
            dump(config, os.path.join(self.output, "config.yaml"))
        self.log = loggers.Loggers(train["log"], self.output) if ctx.rank == 0 else None

        # 4. devices, weights, optimizers
        device = _check_devices(ctx, config)
        mcomm.bind(ctx, device)
        devices = comm.gather(device, root=0)
        if ctx.rank == 0:
            counts = collections.Counter(devices)
            where = ", ".join(f"{d} x{c}" if c > 1 else d for d, c in sorted(counts.items()))
            print(f"mpilearn: {ctx.size} rank(s) on {where}; backend {train['backend']}, "
                  f"precision {train['precision']}", flush=True)
        self.master = None
        if self.algorithm == "allreduce":
            self.task.setup(comm, device, train["backend"], int(train["fusion_mb"] * (1 << 20)))
        else:
            self.master = asyncsgd.setup(self.task, comm, device, train)
        self.base_lrs = self.task.learning_rates()
        check_on_root(comm, dry_run, self.task, self.train_files, self.train_events)
        torch.manual_seed(train["seed"] * 1000 + ctx.rank + 1)  # per-rank noise from here on

        # 5. position and running state
        self.epoch, self.step_in_epoch, self.global_step = 0, 0, 0
        self.acc = self._empty_acc()
        self.best, self.bad_epochs = math.inf, 0
        if resume:
            self._restore()

    def _make_loader(self):
        t = self.config["train"]
        rank, size = self.ctx.rank, self.ctx.size
        if self.algorithm != "allreduce":  # the workers share the data; the master reads none
            rank, size = max(rank - 1, 0), size - 1
        return ShardedLoader(self.train_files, self.train_events, t["batch_size"], rank,
                             size, seed=t["seed"], shuffle=self.config["data"]["shuffle"],
                             prefetch=self.config["data"]["prefetch"], transform=self.task.transform)

    @property
    def steps_per_epoch(self) -> int:
        cap = self.config["train"]["max_steps_per_epoch"]
        return min(self.loader.steps_per_epoch, cap) if cap > 0 else self.loader.steps_per_epoch

    # -- learning rate -------------------------------------------------------------------
    def _set_lr(self) -> float:
        t = self.config["train"]
        factor = 1.0
        if t["lr_scaling"] == "linear":
            warm = t["warmup_epochs"] * self.steps_per_epoch
            ramp = 1.0 if warm <= 0 else min(1.0, (self.global_step + 1) / warm)
            factor = 1.0 + (self.ctx.size - 1) * ramp
        lrs = {k: [base * factor for base in bases] for k, bases in self.base_lrs.items()}
        self.task.set_learning_rates(lrs)
        return next(iter(lrs.values()))[0]

    # -- checkpoints -------------------------------------------------------------------
    @staticmethod
    def _empty_acc() -> dict:
        return {"losses": {}, "steps": 0, "compute": 0.0, "allreduce": 0.0, "data": 0.0,
                "samples": 0, "seconds": 0.0}

    def _save(self) -> None:
        rngs = self.ctx.comm.gather(ckpt.rng_state(), root=0)
        if self.ctx.rank != 0:
            return
        state = {"task": self.task.state_dict(), "epoch": self.epoch,
                 "step_in_epoch": self.step_in_epoch, "global_step": self.global_step,
                 "rng": rngs, "acc": self.acc, "best": self.best, "bad_epochs": self.bad_epochs,
                 "world_size": self.ctx.size}
        ckpt.save(self.ckpt_dir, ckpt.name_for(self.epoch, self.step_in_epoch), state,
                  self.config["train"]["keep_checkpoints"])

    def _restore(self) -> None:
        found = ckpt.load_newest(self.ckpt_dir) if self.ctx.rank == 0 else None
        path, state, failed = self.ctx.comm.bcast(found, root=0)
        if self.ctx.rank == 0:
            for bad, why in failed:
                print(f"mpilearn: checkpoint {bad} does not load ({why}); trying an older one",
                      flush=True)
        if path is None:
            if failed:
                raise UsageError(f"--resume: no checkpoint in {self.ckpt_dir} loads: "
                                 + "; ".join(f"{p}: {why}" for p, why in failed))
            if self.resume != "auto":
                raise UsageError(f"--resume: no checkpoint in {self.ckpt_dir} (use --resume auto "
                                 "to start fresh when there is none)")
            if self.ctx.rank == 0:
                print(f"mpilearn: no checkpoint in {self.ckpt_dir}; starting fresh", flush=True)
            return
        try:
            self.task.load_state_dict(state["task"])
        except (RuntimeError, KeyError, ValueError) as err:  # alike on every rank
            detail = " ".join(line.strip() for line in str(err).strip().splitlines()[:3])
            raise UsageError(f"--resume: {path} is not a checkpoint of this model and optimizer: "
                             f"{detail}") from None
        self.epoch, self.step_in_epoch = state["epoch"], state["step_in_epoch"]
        self.global_step, self.acc = state["global_step"], state["acc"]
        self.best, self.bad_epochs = state["best"], state["bad_epochs"]
        self.history = self.ctx.comm.bcast(self._logged_epochs() if self.ctx.rank == 0 else None)
        rngs = state["rng"]
        if len(rngs) == self.ctx.size:
            ckpt.set_rng_state(rngs[self.ctx.rank])
        elif self.ctx.rank == 0:
            print(f"mpilearn: checkpoint was written by {len(rngs)} ranks, now {self.ctx.size}: "
                  "RNG streams restart", flush=True)
        if self.ctx.rank == 0:
            print(f"mpilearn: resumed from {path} (epoch {self.epoch}, step {self.step_in_epoch})",
                  flush=True)

    def _logged_epochs(self) -> list:
        """Epoch records of the checkpointed epochs (the last one where an epoch repeats)."""
        if not os.path.exists(self.metrics_path):
            return []
        records = {r["epoch"]: r for r in read_jsonl(self.metrics_path)
                   if "time" in r and r["epoch"] <= self.epoch}
        return [records[e] for e in sorted(records)]

    # -- the loop ----------------------------------------------------------------------
    def fit(self) -> dict:
        """Trains to the configured end. A task's TrainingStopped is logged, a stop signal
        (Preempted) checkpoints the exact position; both are then re-raised."""
        from .tasks import TrainingStopped

        try:
            return self._fit()
        except preempt.Preempted as stop:
            self._save()
            if self.ctx.rank == 0:
                print(f"mpilearn: {stop}: checkpoint saved at epoch {self.epoch + 1}, step "
                      f"{self.step_in_epoch}; continue with --resume auto", flush=True)
            raise
        except TrainingStopped as stop:
            if self.ctx.rank == 0:
                # the step that raised is reported; a non-finite one was skipped, not applied
                append_jsonl(self.metrics_path, {"epoch": self.epoch + 1,
                                                 "step": self.global_step + 1, "stopped": str(stop)})
            self._save()
            raise
        finally:
            if self.log is not None:
                self.log.close()

    def _fit(self) -> dict:
        t = self.config["train"]
        every = t["checkpoint_every_steps"]
        last = {}
        stopped = False
        while self.epoch < t["epochs"] and not stopped:
            bar = None
            if self.progress:
                from tqdm import tqdm

                bar = tqdm(total=self.steps_per_epoch, initial=self.step_in_epoch,
                           desc=f"epoch {self.epoch + 1}/{t['epochs']}", unit="step",
                           file=sys.stderr, dynamic_ncols=True, leave=False)
            self.loader.pop_wait()
            self.task.allreduce_seconds()
            self._epoch_start = time.perf_counter()
            lr = self._set_lr()  # also when a resumed epoch has no steps left
            if self.algorithm != "allreduce":
                if bar is not None:
                    bar.close()
                self._async_epoch()
                batches = (b for b in ())
            else:
                batches = self.loader.batches(self.epoch, self.step_in_epoch)
            try:
                for batch in batches:
                    if self.step_in_epoch >= self.steps_per_epoch:
                        break
                    lr = self._set_lr()
                    losses = self.task.train_step(batch)
                    for k, v in losses.items():
                        self.acc["losses"][k] = self.acc["losses"].get(k, 0.0) + v
                    self.acc["steps"] += 1
                    self.acc["samples"] += self.loader.global_batch
                    self.step_in_epoch += 1
                    self.global_step += 1
                    if self.log is not None and t["log_every_steps"] \
                            and self.global_step % t["log_every_steps"] == 0:
                        self.log.steps(self.global_step, losses)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix({k: f"{v:.4g}" for k, v in losses.items()}, refresh=False)
                    self._check_stop()
                    if (every and self.global_step % every == 0
                            and self.step_in_epoch < self.steps_per_epoch):
                        self._account(self._epoch_start)
                        self._epoch_start = time.perf_counter()
                        self._save()
            finally:
                batches.close()
                if bar is not None:
                    bar.close()
            self._account(self._epoch_start)
            record = self._end_epoch(lr)
            last = record
            stopped = self._early_stop(record)
            if self.on_epoch is not None and self.on_epoch(record):
                stopped = True
            self.epoch += 1
            self.step_in_epoch = 0
            self.acc = self._empty_acc()
            self._save()
        if self.ctx.rank == 0:
            # torch models as .pt and .safetensors, Keras ones as .keras
            self.task.export(os.path.join(self.output, "models"))
            print(f"mpilearn: done after {self.epoch} epoch(s); results in {self.output}",
                  flush=True)
        return last

    def _async_epoch(self) -> None:
        """One epoch of downpour/easgd; afterwards every rank holds the centre parameters."""
        from .tasks import TrainingStopped

        comm, workers = self.ctx.comm, self.ctx.size - 1
        if self.ctx.rank == 0:
            stats = self.master.serve_epoch(
                self.steps_per_epoch * workers,
                lambda: preempt.requested() is not None or self._past_deadline())
            done = stats.pop("workers")
            for w in done:
                for k, v in w["losses"].items():
                    self.acc["losses"][k] = self.acc["losses"].get(k, 0.0) + v
                self.acc["steps"] += w["steps"]
                self.acc["samples"] += w["samples"]
            stats["steps_per_worker"] = [w["steps"] for w in done]
            signalled = stats.pop("preempted") or preempt.requested() is not None
            reason = next((w["stopped"] for w in done if w.get("stopped")), None)
            if reason is None and signalled:
                reason = "preempted"
            elif reason is None and self._past_deadline():
                reason = "deadline"
            self.acc["async"] = stats
        else:
            asyncsgd.work_epoch(self, self.task)
            reason = None
        reason = comm.bcast(reason, root=0)
        asyncsgd.broadcast_centre(self.task, comm)
        if reason == "preempted":  # the interrupted epoch runs again from the centre
            self.step_in_epoch, self.acc = 0, self._empty_acc()
            where = preempt.describe() if preempt.requested() else "on another rank"
            raise preempt.Preempted(f"stop signal ({where})")
        self.global_step += self.steps_per_epoch
        if reason == "deadline":
            raise TrainingStopped("the trial ran past its time limit")
        if reason is not None:
            raise TrainingStopped(reason)
        self.step_in_epoch = self.steps_per_epoch

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.time() > self.deadline

    def _check_stop(self) -> None:
        """Collective, after every step: a stop signal on any rank, or the deadline
        (one 4-byte allreduce, no pickling: it is on every step)."""
        from .tasks import TrainingStopped

        MPI = mcomm.mpi()
        flags = np.array([int(preempt.requested() is not None) | int(self._past_deadline()) << 1],
                         dtype=np.int32)
        self.ctx.comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.BOR)
        if flags[0] & 1:
            self._account(self._epoch_start)
            raise preempt.Preempted(f"stop signal ({preempt.describe()})")
        if flags[0] & 2:
            raise TrainingStopped("the trial ran past its time limit")

    def _account(self, start: float) -> None:
        wall = time.perf_counter() - start
        comm_s, data_s = self.task.allreduce_seconds(), self.loader.pop_wait()
        self.acc["seconds"] += wall
        self.acc["allreduce"] += comm_s
        self.acc["data"] += data_s
        self.acc["compute"] += max(0.0, wall - comm_s - data_s)

    def evaluate(self) -> dict:
        """Validation metrics averaged across ranks, over all validation events or, with
        ``train.max_steps_per_epoch``, at most that many batches per rank (as training);
        ``val_events`` says how many were evaluated."""
        if len(self.val_events) == 0:
            return {}
        sums, count = {}, 0
        cap = self.config["train"]["max_steps_per_epoch"]
        batches = eval_batches(self.val_source, self.val_events,
                               self.config["train"]["batch_size"], self.ctx.rank,
                               self.ctx.size, self.task.transform)
        for batch in itertools.islice(batches, cap if cap > 0 else None):
            for k, v in self.task.eval_batch(batch).items():
                sums[k] = sums.get(k, 0.0) + v
            count += len(next(iter(batch.values())))
        names = sorted(set().union(*self.ctx.comm.allgather(set(sums))))
        vec = np.array([sums.get(k, 0.0) for k in names] + [count], dtype=np.float64)
        total = self.ctx.comm.allreduce(vec)
        return {**{f"val_{k}": float(total[i] / max(total[-1], 1)) for i, k in enumerate(names)},
                "val_events": int(total[-1])}

    def _end_epoch(self, lr: float) -> dict:
        comm, acc = self.ctx.comm, self.acc
        names = sorted(set().union(*comm.allgather(set(acc["losses"]))))
        local = np.array([acc["losses"].get(k, 0.0) for k in names] + [acc["steps"]],
                         dtype=np.float64)
        total = comm.allreduce(local)
        train = {k: float(total[i] / max(total[-1], 1)) for i, k in enumerate(names)}
        val = self.evaluate()
        split = {k: round(acc[k], 4) for k in ("compute", "allreduce", "data", "seconds")}
        per_rank = comm.gather(split, root=0)
        record = {"epoch": self.epoch + 1, "step": self.global_step, "lr": lr,
                  **{f"train_{k}": v for k, v in train.items()}, **val,
                  "samples_per_s": acc["samples"] / acc["seconds"] if acc["seconds"] else None,
                  "time": split, "time_per_rank": per_rank, "ranks": self.ctx.size}
        if "async" in acc:
            record["async"] = acc["async"]
        record.update(self._physics())
        self.history.append(record)
        if self.ctx.rank == 0:
            append_jsonl(self.metrics_path, record)
            self.log.epoch(record)
            shown = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in record.items()
                     if k.startswith(("train_", "val_")) or k in HEADLINE_PHYSICS or k == "samples_per_s"}
            print(f"epoch {record['epoch']}: {shown}", flush=True)
        return record

    def _physics(self) -> dict:
        """Physics score of generated vs validation showers, every validate_every epochs."""
        every = self.config["train"]["validate_every"]
        if not every or (self.epoch + 1) % every or not hasattr(self.task, "generate"):
            return {}
        from ..physics import validate_task

        events = self.val_events if len(self.val_events) else self.train_events
        folder = os.path.join(self.output, "validation", f"epoch{self.epoch + 1:04d}")
        title = f"run {os.path.basename(os.path.abspath(self.output))} epoch {self.epoch + 1}"
        result = validate_task(self.task, self.val_source, events, self.ctx.comm, folder,
                               self.config["train"]["physics_events"], title=title)
        if self.log is not None and result.get("plots"):
            self.log.images(self.epoch + 1, result["plots"])
        return {k if k in HEADLINE_PHYSICS else f"physics_{k}": v for k, v in result.items()
                if not isinstance(v, (list, dict))}

    def _early_stop(self, record: dict) -> bool:
        es = self.config["train"]["early_stopping"]
        if es["patience"] <= 0:
            return False
        value = record.get(es["monitor"])
        if value is None:
            raise UsageError(f"train.early_stopping.monitor '{es['monitor']}' is not a logged "
                             f"metric (have: {', '.join(sorted(record))})")
        if value < self.best - es["min_delta"]:
            self.best, self.bad_epochs = value, 0
        else:
            self.bad_epochs += 1
        if self.bad_epochs >= es["patience"]:
            if self.ctx.rank == 0:
                print(f"mpilearn: early stopping: {es['monitor']} has not improved for "
                      f"{self.bad_epochs} epoch(s)", flush=True)
            return True
        return False


# the physics validation's three numbers, logged under their own names (their terms and the
# per-bin values as physics_*)
HEADLINE_PHYSICS = ("score", "reference_metric", "sampling_fraction_mre")


def logged_metrics(task, config: dict) -> set:
    """Names every epoch record of ``task`` will carry (checked before an HPO sweep starts)."""
    names = {"epoch", "step", "lr", "samples_per_s"}
    names |= {f"train_{k}" for k in getattr(task, "loss_names", ())}
    names |= {f"val_{k}" for k in getattr(task, "val_names", ())}
    if config["train"]["validate_every"] and hasattr(task, "generate"):
        terms = ["moments", "profiles"] + (["angle"] if getattr(task, "variant", "") == "angle" else [])
        names |= set(HEADLINE_PHYSICS) | {"physics_sampling_fraction_mre_error"}
        names |= {f"physics_{p}{t}" for p in ("", "reference_") for t in terms}
    return names
