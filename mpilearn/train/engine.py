"""The training driver shared by every task, strategy and launch context.

Plan, then build, so that bad input is reported before anything expensive starts: the plan
(``plan.py``) checks everything (run directory, model, data, devices, resume) with one verdict
from rank 0; then the driver builds from it: task, data, strategy set-up (weights broadcast),
callbacks, the resumed state; then the epochs. The driver owns the data, checkpoints, the position,
stop signals and the epoch record; how ranks combine their updates is the strategy's
(``strategies.py``), and everything done with an epoch record is a callback (``callbacks.py``).
Everything takes the communicator it is given.
"""
from __future__ import annotations

import collections
import copy
from dataclasses import replace
import os
import sys
import time
from typing import Optional

import numpy as np
import torch

from ..core import comm as mcomm
from ..core import watchdog
from ..cluster import preempt
from ..core.config import dump
from ..data.hdf5 import ShardedLoader
from ..data.position import from_steps, steps_left
from ..errors import TrainingStopped, UsageError
from ..core.io import append_jsonl, read_jsonl
from . import checkpoint as ckpt
from . import best, elastic, loggers, resize, stops
from .callbacks import BestCheckpoint, EarlyStopping, EpochLog, task_callbacks
from .checks import clear_run_dir, remove_stale_temp
from .evaluation import evaluate, test_pass
from .plan import make as make_plan
from .scaling import Scaling
from .setup import new_task, shared_files
from .strategies import EpochContext, make_strategy


def resume_line(path: str, epoch: int, step_in_epoch: int, epochs: int) -> str:
    """Rank 0's line at a resume: where the checkpoint was saved and where training goes on.
    ``epoch`` counts the epochs finished (0-based index of the one in progress),
    ``step_in_epoch`` the steps applied in that one; the line counts epochs and steps from 1."""
    if step_in_epoch:
        return (f"mpilearn: resumed from {path}, saved in epoch {epoch + 1} after step "
                f"{step_in_epoch} of it: going on with its step {step_in_epoch + 1}")
    saved = f"at the end of epoch {epoch}" if epoch else "before the first step"
    after = f"going on with epoch {epoch + 1}" if epoch < epochs else \
        f"all {epochs} epoch(s) of train.epochs are done"
    return f"mpilearn: resumed from {path}, saved {saved}: {after}"


class Trainer:
    def __init__(self, config: dict, ctx, output: Optional[str] = None, resume=False,
                 progress: bool = True, events: Optional[tuple] = None,
                 deadline: Optional[float] = None, overwrite: bool = False,
                 force: bool = False, announce_fresh: bool = True, joining=None):
        """``resume``: False, True (a checkpoint must exist) or "auto" (continue from one if
        there is one); ``events``: explicit (train, validation) event indices (HPO folds);
        ``deadline``: a time.time() after which training stops with TrainingStopped;
        ``overwrite``: replace an earlier run in ``output``; ``force``: resume although the
        config changed in what is trained; ``announce_fresh``: say that ``resume="auto"`` found
        no checkpoint (an HPO fold does not: the sweep says it once). ``callbacks`` may be
        extended before ``fit()``; ``joining``: rank 0's plan, in a process spawned to join
        a running job (``Trainer.newcomer``): no checks, no writes, its own ranks only.
        ``spawn_command`` (set by the entry point): what such a process runs, None where the
        run cannot grow in process."""
        self.config, self.ctx, self.resume = config, ctx, resume
        self.deadline, self.history = deadline, []
        self.announce_stop = True  # an HPO fold leaves the stop line to the sweep
        self.step_watch = None  # called on each rank after every step; raises to leave (hpo)
        writer = ctx.rank == 0 and joining is None  # a newcomer never writes
        self.progress = progress and writer
        self.spawn_command = None
        comm = ctx.comm
        train = config["train"]

        # 1. plan: every check (config, model, data, devices, resume), one verdict from rank 0
        if joining is None:
            plan = make_plan(config, ctx, output, resume, events, overwrite, force)
        else:  # rank 0's, checked there; this process's own device
            from .checks import choose_device

            plan = replace(joining, device=choose_device(ctx, config)[0] or "cpu")
        notes = plan.notes + ([plan.fresh] if plan.fresh and announce_fresh else [])
        for note in notes if writer else ():
            print(note, flush=True)
        # what a newcomer needs of it (the checkpoint's state and rank 0's task stay here)
        self.plan = replace(plan, task=None, checkpoint=None, notes=[], fresh="")

        # 2. build from the plan: the task, data, strategy, output directory, callbacks
        self.output, self.monitors = plan.output, plan.monitors
        self.task = plan.task if plan.task is not None else new_task(config)
        mcomm.wait_idle(comm)  # rank 0 built its task for the checks: it waits asleep
        self.train_files, self.val_files, self.test_files = shared_files(
            plan.files, self.task, config["data"]["on_error"])
        self.train_events, self.val_events = plan.events
        self.val_source = self.val_files or self.train_files
        self.strategy = make_strategy(train, comm)
        self.batch_size = plan.batch_size or train["batch_size"]  # per rank, in force
        self.loader = self._make_loader()

        # rank 0 writes; stale temp files of killed writes go
        self.ckpt_dir = os.path.join(self.output, "checkpoints")
        self.metrics_path = os.path.join(self.output, "metrics.jsonl")
        if writer:
            if overwrite:
                clear_run_dir(self.output)
            os.makedirs(self.ckpt_dir, exist_ok=True)
            for path in remove_stale_temp([self.output, self.ckpt_dir]):
                print(f"mpilearn: removed {path}, left by an interrupted write", flush=True)
        self.log = loggers.Loggers(train["log"], self.output) if writer else None

        # the device, then the strategy: weights broadcast, optimizers wrapped
        mcomm.bind(ctx, plan.device)
        devices = comm.gather(plan.device, root=0)
        if writer:
            counts = collections.Counter(devices)
            where = ", ".join(f"{d} x{c}" if c > 1 else d for d, c in sorted(counts.items()))
            print(f"mpilearn: {ctx.size} rank(s) on {where}; backend {train['backend']}, "
                  f"precision {train['precision']}, compile {train['compile']}", flush=True)
        self.strategy.setup(self.task, plan.device)
        self.scaling = Scaling(train, self.task)
        self._seed_rank_streams()
        self.callbacks = self._default_callbacks()
        self.membership, self.snapshots = None, None
        if elastic.settings(config) is not None:
            self._make_elastic(elastic.settings(config))

        # position (the epoch's events consumed, and its steps taken) and running state
        self.epoch, self.step_in_epoch, self.global_step, self.position = 0, 0, 0, 0
        self.acc = self._empty_acc()
        if plan.checkpoint:
            self._restore(*plan.checkpoint)
        if self.snapshots is not None:
            self.snapshots.maybe_take(self, force=True)
            if writer:
                e = elastic.settings(config)
                at = " (local SGD's averages)" if self.strategy.name == "local_sgd" else ""
                print(f"mpilearn: elastic: min_ranks {e['min_ranks']}; an in-memory snapshot "
                      f"every {self.snapshots.every} step(s){at}, "
                      f"{self.snapshots.kept[-1].nbytes() / 2**20:.3g} MiB each, 2 kept",
                      flush=True)
        # the run's identity, written once every check passed (a refused --resume --force
        # leaves the saved config as it was)
        if writer:
            dump(dict(config, output=self.output), os.path.join(self.output, "config.yaml"))

    def _make_elastic(self, settings: dict) -> None:
        """The membership every holder of the communicator follows (the one ``train``'s main
        made before start-up, where it did), and the snapshots."""
        from ..core import membership

        m = membership.current()
        if m is None or m.comm is not self.ctx.comm:
            m = membership.Membership.for_context(self.ctx, int(settings["min_ranks"]),
                                                  int(settings.get("max_ranks") or 0))
        self.membership = m

        def follow(new, change):  # the one list of who holds the job's communicator
            self.strategy.rebind(new)
            self.task.rebind(new)

        self.membership.on_change(follow)
        # local SGD's at its averages only (strategies.LocalSGD)
        self.snapshots = elastic.Snapshots(
            self.strategy.snapshot_every(int(settings.get("snapshot_every") or 1)))
        self._first_after_loss = False

    def _make_loader(self):
        t = self.config["train"]
        rank, size = self.strategy.shard(self.ctx.rank, self.ctx.size)
        return ShardedLoader(self.train_files, self.train_events, self.batch_size, rank,
                             size, seed=t["seed"], shuffle=self.config["data"]["shuffle"],
                             prefetch=self.config["data"]["prefetch"], transform=self.task.transform)

    def _default_callbacks(self) -> list:
        """The task's own (e.g. physics validation), the epoch log, the best checkpoint's
        tracker, early stopping: in this order."""
        t, rank = self.config["train"], self.ctx.rank
        out = [cls.for_trainer(self) for cls in task_callbacks(self.task, self.config)]
        headline = {name for cb in out for name in cb.headline}
        summaries = [cb.summary for cb in out if cb.summary is not None]
        out.append(EpochLog(self.metrics_path, self.log, rank, headline, summaries))
        if self.monitors["best"]:
            out.append(BestCheckpoint(*self.monitors["best"]))
        es = t["early_stopping"]
        if self.monitors["early_stopping"]:
            monitor, mode = self.monitors["early_stopping"]
            out.append(EarlyStopping(monitor, es["patience"], es["min_delta"], rank, mode))
        return out

    @property
    def steps_per_epoch(self) -> int:
        """A whole epoch's steps at the current size."""
        cap = self.config["train"]["max_steps_per_epoch"]
        return min(self.loader.steps_per_epoch, cap) if cap > 0 else self.loader.steps_per_epoch

    def _steps_left(self) -> int:
        """The epoch's steps from the current position (``max_steps_per_epoch`` caps the
        steps taken in the epoch, at whatever sizes)."""
        left = steps_left(len(self.loader.events), self.position, self.loader.global_batch)
        cap = self.config["train"]["max_steps_per_epoch"]
        return min(left, max(0, cap - self.step_in_epoch)) if cap > 0 else left

    def _warmup_step(self, spe: int, global_batch: int) -> float:
        """The position as steps of this size since the run began (the warm-up follows the
        data, so it survives a size change; at one size it is the global step)."""
        return self.epoch * spe + self.position / global_batch

    # -- learning rate ---------------------------------------------------------------------
    @property
    def lr(self):
        return self.scaling.lr

    def _set_lr(self) -> float:
        """Every optimizer's rates for the next step (``scaling.py``); returns the first."""
        spe = self.steps_per_epoch
        return self.scaling.set_lr(self.ctx.size, self.batch_size, spe,
                                   self._warmup_step(spe, self.loader.global_batch))

    # -- checkpoints -------------------------------------------------------------------
    @staticmethod
    def _empty_acc() -> dict:
        return {"losses": {}, "steps": 0, "compute": 0.0, "allreduce": 0.0, "data": 0.0,
                "samples": 0, "seconds": 0.0}

    def _save(self) -> Optional[str]:
        """Collective; rank 0 writes the checkpoint and returns its path."""
        rngs = self.ctx.comm.gather(ckpt.rng_state(self.task), root=0)
        # every rank's running sums: a resumed epoch's record is then the uninterrupted one's
        accs = self.ctx.comm.gather(self.acc, root=0)
        strategy = self.strategy.state_dict()  # collective: other ranks' own state
        path = None
        if self.ctx.rank == 0:
            state = {"task": self.task.state_dict(), "epoch": self.epoch,
                     "step_in_epoch": self.step_in_epoch, "global_step": self.global_step,
                     # events consumed in the epoch: any rank count reads on from here
                     "position": self.position, "global_batch": self.loader.global_batch,
                     "local_batch": self.batch_size,
                     "rng": rngs, "acc": self.acc, "acc_per_rank": accs,
                     "world_size": self.ctx.size,
                     "strategy": strategy, "scaling": self.scaling.state_dict(),
                     "callbacks": {cb.name: cb.state_dict() for cb in self.callbacks}}
            path = ckpt.save(self.ckpt_dir, ckpt.name_for(self.epoch, self.step_in_epoch), state,
                             self.config["train"]["keep_checkpoints"])
        mcomm.wait_idle(self.ctx.comm)  # the others wait asleep while rank 0 writes
        return path

    def _restore(self, path: str, state: dict) -> None:
        """Every rank loads the checkpoint the plan chose."""
        try:
            self.task.load_state_dict(state["task"])
            self.strategy.load_state_dict(state.get("strategy") or {})
            self.scaling.load_state_dict(state.get("scaling") or {})
        except (RuntimeError, KeyError, ValueError) as err:  # alike on every rank
            detail = " ".join(line.strip() for line in str(err).strip().splitlines()[:3])
            raise UsageError(f"--resume: {path} is not a checkpoint of this model and optimizer: "
                             f"{detail}") from None
        self.epoch, self.step_in_epoch = state["epoch"], state["step_in_epoch"]
        self.global_step = state["global_step"]
        saved_global, saved_ranks = resize.saved_batches(state, self.config["train"]["batch_size"])
        if "position" not in state:  # written before positions were kept
            g = self.loader.global_batch if saved_ranks == self.ctx.size else saved_global
            state["position"] = from_steps(self.step_in_epoch, g)
        self.position = state["position"]
        self.acc = self._restored_acc(state)
        saved = state.get("callbacks", {})
        for cb in self.callbacks:
            if saved.get(cb.name):
                cb.load_state_dict(saved[cb.name])
        self.history = self.ctx.comm.bcast(self._logged_epochs() if self.ctx.rank == 0 else None)
        rngs = state["rng"]
        if len(rngs) == self.ctx.size:
            ckpt.set_rng_state(rngs[self.ctx.rank], self.task)
        elif self.ctx.rank == 0:
            print(self._resize_line(saved_global, saved_ranks), flush=True)
            if self.membership is not None:  # an elastic job relaunched at another size (grown)
                append_jsonl(self.metrics_path, {
                    "epoch": self.epoch + 1, "step": self.global_step,
                    "membership": {"old_size": saved_ranks, "ranks": self.ctx.size,
                                   "relaunched": True},
                    "position": self.position, "global_batch": self.loader.global_batch})
        if self.ctx.rank == 0:
            print(resume_line(path, self.epoch, self.step_in_epoch, self.config["train"]["epochs"]),
                  flush=True)

    def _resize_line(self, old_global: int, old_ranks: int) -> str:
        """Rank 0's one line at a resume on another rank count: sizes, batches, lr."""
        t, loader = self.config["train"], self.loader
        cap, n = t["max_steps_per_epoch"], len(loader.events)

        def lr(ranks, global_batch):
            spe = min(n // global_batch, cap) if cap > 0 else n // global_batch
            return self.scaling.base_lr(ranks, global_batch // ranks, spe,
                                        self._warmup_step(spe, global_batch))

        return resize.describe(old_ranks, self.ctx.size, old_global, self.batch_size,
                               loader.global_batch, t["elastic"]["batch"],
                               lr(old_ranks, old_global), lr(self.ctx.size, loader.global_batch),
                               t["lr_scaling"], f"epoch {self.epoch + 1}, event {self.position} "
                               f"of {n}")

    def _restored_acc(self, state: dict) -> dict:
        """This rank's running sums of the checkpointed epoch. With another rank count, the
        saved ranks' loss sums and step counts go to rank 0 (the epoch's means stay right);
        a checkpoint from before ``acc_per_rank`` held rank 0's sums only."""
        accs = state.get("acc_per_rank") or [state["acc"]]
        if len(accs) == self.ctx.size:
            return accs[self.ctx.rank]
        if self.ctx.rank != 0:
            return self._empty_acc()
        acc = dict(accs[0], losses={}, steps=sum(a["steps"] for a in accs))
        for a in accs:
            for k, v in a["losses"].items():
                acc["losses"][k] = acc["losses"].get(k, 0.0) + v
        return acc

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
        # named by its world rank: in a sweep, the fold's rank would not say which process
        world_rank = mcomm.mpi().COMM_WORLD.Get_rank()
        self.watchdog = watchdog.from_config(self.config["train"], world_rank, self.output)
        if self.watchdog is not None:
            self.watchdog.start()
        try:
            return self._fit()
        except preempt.Preempted as stop:
            path = self._save()
            if self.ctx.rank == 0 and self.announce_stop:  # the one line a stop signal gets
                print(f"mpilearn: {stop}; checkpoint {path}; continue with --resume auto",
                      flush=True)
            raise
        except TrainingStopped as stop:
            if self.ctx.rank == 0:
                # the step that raised is reported; a non-finite one was skipped, not applied
                append_jsonl(self.metrics_path, {"epoch": self.epoch + 1,
                                                 "step": self.global_step + 1, "stopped": str(stop)})
            self._save()
            raise
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()
            if self.log is not None:
                self.log.close()

    def _fit(self) -> dict:
        t = self.config["train"]
        last = {}
        stopped = False
        if self.membership is not None:  # from here on a lost rank is recovered from
            self.membership.phase = "training"
        if self.ctx.rank == 0 and self.loader.global_batch != self.scaling.base_batch:
            print("\n".join(self.scaling.describe(self.ctx.size, self.batch_size)), flush=True)
        while self.epoch < t["epochs"] and not stopped:
            if self.membership is not None:
                from ..core.membership import run_guarded

                record, stopped = run_guarded(self.membership, self._one_epoch,
                                              self._after_loss, self._grow)
            else:
                record, stopped = self._one_epoch()
            last = record
        if self.membership is not None:
            self.membership.phase = "the end of the run (after the last epoch)"
        if self.test_files is not None:
            last["test"] = test_pass(self.task, self.test_files, self.config["train"]["batch_size"],
                                     self.ctx.comm, self.output, self.epoch, self.config)
        if self.ctx.rank == 0:
            line = self.scaling.end_line(self.batch_size, self.ctx.size)
            if line:
                print(line, flush=True)
            # torch models as .pt and .safetensors, Keras ones as .keras
            self.task.export(os.path.join(self.output, "models"))
            print(f"mpilearn: done after {self.epoch} epoch(s); results in {self.output}",
                  flush=True)
        return last

    def _one_epoch(self) -> tuple:
        """The epoch from the current position, its record, callbacks and checkpoint; returns
        (record, whether a callback stops training)."""
        self._run_epoch()
        self._account(self._epoch_start)
        self.strategy.end_epoch()
        record = self._epoch_record()
        self.history.append(record)
        # every callback runs (none is skipped because an earlier one stops)
        stopped = any([cb.on_epoch_end(record) for cb in self.callbacks])
        self.epoch += 1
        self.step_in_epoch, self.position = 0, 0
        self.acc = self._empty_acc()
        best.keep_if_improved(self.task, self.output, self._save(), self.callbacks)
        if self.snapshots is not None:
            self.snapshots.maybe_take(self, force=True)
        return record, stopped

    def _after_loss(self, change) -> None:
        """The survivors of a lost rank (``membership.recover`` gave them their communicator):
        back to the newest step every one of them holds, the rest of the epoch re-sharded;
        rank 0's duties to the lowest survivor; below min_ranks, a checkpoint and exit 75."""
        from ..core import membership

        where = self.membership.agree_min(self.snapshots.newest())
        if where == membership.NO_SNAPSHOT:  # some survivor was still starting: all end, exit 75
            raise membership.before_training(change, "start-up (of other ranks)")
        if change.leader_lost and self.ctx.rank == 0:
            self._take_over_leader()
        # the step in flight (a snapshot may be older: local SGD's are at its averages)
        in_flight, epoch = self.global_step + 1, self.epoch + 1
        self._restore_snapshot(self.snapshots.at(where))
        self._membership_changed(change)
        lr = self._set_lr()
        below = change.new_size < self.membership.min_ranks
        if self.ctx.rank == 0:  # the one line (below min_ranks, exit_status says the rest)
            how = ", ".join(f"rank {r} on {h}" for r, h in change.lost)
            if not below:
                print(f"mpilearn: lost {how} at step {in_flight} (epoch "
                      f"{epoch}); going on with {self.ctx.size} rank(s) from step "
                      f"{self.global_step}, global batch {self.loader.global_batch}, lr {lr:.6g}"
                      + (f"; rank 0 was lost: its duties (checkpoints, logs) moved to rank "
                         f"{change.new_rank} (formerly rank {change.old_rank})"
                         if change.leader_lost else ""), flush=True)
            self._record_membership(change, lr)
        self._first_after_loss = True
        if below:
            self._save()
            raise membership.TooFewRanks(change, self.membership.min_ranks,
                                         self.global_step)

    def _seed_rank_streams(self) -> None:
        """Per-rank noise (dropout, a task's own draws) from here on: a stream per rank, which
        restarts when the rank count changes (a resume at another size, an elastic change)."""
        torch.manual_seed(self.config["train"]["seed"] * 1000 + self.ctx.rank + 1)
        self.task.restart_streams()  # Keras's seed generators: as the set-up left them

    def _restore_snapshot(self, snap) -> None:
        """Every survivor back to ``snap`` (its own copy of that step), on the new size."""
        # a copy: an optimizer's load_state_dict keeps the very tensors it is given, and the
        # snapshot must stay as it is (a second loss before the next one goes back to it)
        self.task.load_state_dict(copy.deepcopy(snap.task))
        # every rank takes rank 0's models, as a resume from rank 0's checkpoint does: the
        # weights are equal already, but per-rank buffers are not (batch-norm running stats,
        # which the 3DGAN's generator uses in eval mode for D's fake batch)
        self.task.sync_models(self.ctx.comm, 0)
        self.strategy.restored(snap.ranks != self.ctx.size)
        self.epoch, self.step_in_epoch = snap.epoch, snap.step_in_epoch
        self.global_step, self.acc = snap.global_step, dict(snap.acc, losses=dict(snap.acc["losses"]))
        self.position = snap.position
        if snap.ranks == self.ctx.size:
            ckpt.set_rng_state(snap.rng, self.task)
        else:  # as a resume on another rank count does, so that the run equals that replay
            self._seed_rank_streams()
        self._resize_batch(snap)
        # the defaults again (rank 0's duties may have moved); one a caller added stays
        defaults = self._default_callbacks()
        names = {cb.name for cb in defaults}
        self.callbacks = defaults + [cb for cb in self.callbacks if cb.name not in names]
        for cb in self.callbacks:
            if snap.callbacks.get(cb.name):
                cb.load_state_dict(snap.callbacks[cb.name])
        self.snapshots.kept = [snap]

    def _resize_batch(self, snap) -> None:
        """The per-rank batch on the new size (``train.elastic.batch``) and the loader for it.
        A global batch the survivors cannot share: a checkpoint, then the UsageError."""
        shards = self.strategy.shard(self.ctx.rank, self.ctx.size)[1]
        try:
            self.batch_size = resize.local_batch(self.config["train"], shards,
                                                 (snap.global_batch, snap.ranks))
        except UsageError:
            self._save()
            raise
        self.loader = self._make_loader()

    def _take_over_leader(self) -> None:
        """Rank 0 was lost: this process (the lowest survivor) becomes the run's one writer."""
        from ..core import runlock

        if self.log is not None:  # taken over already (a recovery that a second loss restarted)
            return
        self.log = loggers.Loggers(self.config["train"]["log"], self.output)
        lock = runlock.RunLock(os.path.join(self.output, runlock.NAME), self.output)
        lock.acquire(force=True)  # its holder is the lost rank 0: MPI said so
        import atexit

        atexit.register(lock.release)

    def _membership_changed(self, change) -> None:
        """Collective: every callback hears the change (``Callback.on_membership``)."""
        for cb in self.callbacks:
            hook = getattr(cb, "on_membership", None)
            if hook is not None:
                hook(self.ctx.comm, change)

    def _record_membership(self, change, lr: float) -> None:
        """Rank 0: the change in metrics.jsonl, with where the run goes on from; the launcher's
        discovery poll learns the new size (to grow back from here)."""
        from ..cluster import discovery

        append_jsonl(self.metrics_path, {
            "epoch": self.epoch + 1, "step": self.global_step, "membership": change.record(),
            "position": self.position, "global_batch": self.loader.global_batch, "lr": lr})
        discovery.answer(os.environ.get(preempt.NOTE_ENV), self.ctx.size)

    # -- growing in process (a discovery script offered more slots) ----------------------
    def _growth_asked(self, stop):
        """Collective, on an agreed stop of an elastic run: a growth that the launcher asked
        for (rank 0 reads its note) as :class:`membership.Growing`; else ``stop``, which
        checkpoints and exits 75 (where the run cannot spawn, with the reason: the launcher
        then relaunches it at the new size)."""
        from ..cluster import discovery
        from ..core import membership

        asked = discovery.requested(os.environ.get(preempt.NOTE_ENV)) \
            if self.ctx.rank == 0 else None
        asked = self.ctx.comm.bcast(asked, root=0)
        if asked is None or asked[0] <= self.ctx.size:
            return stop
        why = ("MPILEARN_SPAWN=0" if os.environ.get("MPILEARN_SPAWN", "1") == "0" else
               None if self.spawn_command else "only python -m mpilearn.train runs do")
        if why:
            return preempt.Preempted(f"{stop}; not growing in process ({why}): relaunching")
        return membership.Growing(asked[0], asked[1], str(stop))

    def _grow(self, growing) -> None:
        """Every rank, at the step boundary where the growth was agreed: spawn the new ranks,
        send them the run (rank 0's plan, config and this step's state), go on together. A
        failed spawn stops the run as the launcher's signal asked (checkpoint, exit 75), and
        the launcher relaunches it at the new size."""
        from ..core import membership

        start = time.perf_counter()
        count = growing.ranks - self.ctx.size
        # watched as a step: a newcomer that dies or hangs before it joins (ULFM does not
        # see a spawned process fail: open-mpi/ompi#13325) would leave the job waiting here
        with watchdog.watching(self.watchdog):
            try:
                merged = membership.spawn(self.ctx.comm, count, self.spawn_command,
                                          growing.hosts)
            except mcomm.mpi().Exception as err:
                raise preempt.Preempted(f"{growing.reason}; spawning {count} rank(s) failed "
                                        f"({err.Get_error_string()}): relaunching") from None
            self.snapshots.maybe_take(self, force=True)
            snap = self.snapshots.kept[-1]
            merged.bcast(elastic.Joining(self.config, self.plan, snap, self.spawn_command)
                         if self.ctx.rank == 0 else None, root=0)
            self._join(merged, snap, newcomer=False, started=start)
        preempt.reset()  # the launcher's SIGUSR1 asked for this growth, not for a stop

    @classmethod
    def newcomer(cls, ctx, merged) -> "Trainer":
        """In a process spawned by :meth:`_grow`: the running job's Trainer, built on this
        process's own ranks from rank 0's plan, then joined to the job at its step."""
        joining = merged.bcast(None, root=0)
        trainer = cls(joining.config, ctx, output=joining.plan.output, progress=False,
                      joining=joining.plan)
        trainer.spawn_command = joining.command
        joining.snapshot.acc = trainer._empty_acc()  # rank 0's running sums are its own
        trainer._join(merged, joining.snapshot, newcomer=True)
        return trainer

    def _join(self, merged, snap, newcomer: bool, started: Optional[float] = None) -> None:
        """Collective over the grown job: its communicator everywhere, rank 0's models, the
        position re-sharded on the new size (as a resume at that size), the one line (the
        seconds from the spawn to the newcomers' arrival here: the old ranks' pause)."""
        old_lr = self.lr
        change = self.membership.grow(merged, newcomer, started)
        mcomm.bind(self.ctx, self.ctx.device)  # CPU threads for the ranks now on this node
        self._restore_snapshot(snap)
        if newcomer:  # the run's record of its launch comes from rank 0
            from .launches import Launches

            self.callbacks.append(Launches(self.ctx.comm, None, self.ctx.device))
        self._membership_changed(change)
        lr = self._set_lr()
        if self.ctx.rank == 0:
            how = ", ".join(f"rank {r} on {h}" for r, h in change.added)
            print(f"mpilearn: grew to {self.ctx.size} ranks at step {self.global_step} (epoch "
                  f"{self.epoch + 1}): spawned {how} in {change.seconds:.3g} s; global batch "
                  f"{self.loader.global_batch}, lr {old_lr or lr:.6g} -> {lr:.6g}", flush=True)
            self._record_membership(change, lr)

    def _run_epoch(self) -> None:
        """The strategy's epoch from the current position; the position follows it."""
        t = self.config["train"]
        self.loader.pop_wait()
        self.task.allreduce_seconds()
        self.strategy.pop_seconds()
        self._epoch_start = time.perf_counter()
        self._set_lr()  # also when a resumed epoch has no steps left
        left = self._steps_left()
        ec = EpochContext(epoch=self.epoch, steps=self.steps_per_epoch, loader=self.loader,
                          acc=self.acc, batch_size=self.batch_size, set_lr=self._set_lr,
                          after_step=self._after_step, check_read=self._check_read,
                          stop_requested=lambda: (preempt.requested() is not None
                                                  or self._past_deadline()),
                          step_in_epoch=self.step_in_epoch, global_step=self.global_step,
                          position=self.position, steps_left=left)
        self.bar = None
        if self.progress and self.strategy.trains:
            from tqdm import tqdm

            self.bar = tqdm(total=self.step_in_epoch + left, initial=self.step_in_epoch,
                            desc=f"epoch {self.epoch + 1}/{t['epochs']}", unit="step",
                            file=sys.stderr, dynamic_ncols=True, leave=False)
        # the steps are watched; an epoch's end (validation, plots) is not: its time is no step's
        if self.watchdog is not None and self.strategy.beats:
            self.watchdog.arm()
        try:
            self.strategy.run_epoch(ec)
        finally:
            if self.watchdog is not None:
                self.watchdog.pause()
            if self.bar is not None:
                self.bar.close()
            if ec.restart:  # an asynchronous epoch stopped by a signal runs again
                self.step_in_epoch, self.position, self.acc = 0, 0, self._empty_acc()
            elif ec.finished_steps is not None:
                self.global_step += ec.finished_steps - self.step_in_epoch
                self.step_in_epoch = ec.finished_steps
                self.position = ec.finished_steps * self.loader.global_batch

    def _after_step(self, losses: dict, upcoming=None) -> None:
        """After every synchronous step: counters, step logs, the stop check (which also
        covers the read of the ``upcoming`` batch), and the periodic checkpoint."""
        t = self.config["train"]
        if self.watchdog is not None:
            self.watchdog.beat()
        for k, v in losses.items():
            self.acc["losses"][k] = self.acc["losses"].get(k, 0.0) + v
        self.acc["steps"] += 1
        self.acc["samples"] += self.loader.global_batch
        self.step_in_epoch += 1
        self.global_step += 1
        self.position += self.loader.global_batch
        if self.log is not None and t["log_every_steps"] \
                and self.global_step % t["log_every_steps"] == 0:
            self.log.steps(self.global_step, losses)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in losses.items()}, refresh=False)
        self._check_stop(upcoming)
        if self.snapshots is not None:
            self.snapshots.maybe_take(self)
            if self._first_after_loss and self.ctx.rank == 0:  # recovery time (bench/elastic.py)
                append_jsonl(self.metrics_path, {"epoch": self.epoch + 1, "step": self.global_step,
                                                 "first_step_after_loss_at": time.time()})
            self._first_after_loss = False
        every = t["checkpoint_every_steps"]
        if every and self.global_step % every == 0 and self._steps_left() > 0:
            self._account(self._epoch_start)
            self._epoch_start = time.perf_counter()
            self._save()

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.time() > self.deadline

    def _check_read(self, first) -> None:
        """Collective, before an epoch's first step: did its read fail on any rank?"""
        self._check_stop(first, signals=False)

    def _check_stop(self, upcoming=None, signals: bool = True) -> None:
        """Collective, after every step (``stops.agree``): a signal, a failed read of the
        ``upcoming`` batch, or the deadline, on any rank, stops every rank here."""
        if self.step_watch is not None:
            self.step_watch()
        stop = stops.agree(self.ctx.comm, upcoming, self._past_deadline(), signals)
        if isinstance(stop, preempt.Preempted):
            self._account(self._epoch_start)
            if self.membership is not None:
                stop = self._growth_asked(stop)
        if stop is not None:
            raise stop

    def _account(self, start: float) -> None:
        wall = time.perf_counter() - start
        comm_s = self.task.allreduce_seconds() + self.strategy.pop_seconds()
        data_s = self.loader.pop_wait()
        self.acc["seconds"] += wall
        self.acc["allreduce"] += comm_s
        self.acc["data"] += data_s
        self.acc["compute"] += max(0.0, wall - comm_s - data_s)

    def evaluate(self) -> dict:
        """Validation metrics averaged across ranks (``evaluation.evaluate``)."""
        return evaluate(self.task, self.val_source, self.val_events,
                        self.config["train"]["batch_size"], self.ctx.comm,
                        self.config["train"]["max_steps_per_epoch"])

    def _epoch_record(self) -> dict:
        """The epoch's training losses (global means), validation and time split."""
        comm, acc = self.ctx.comm, self.acc
        names = sorted(set().union(*comm.allgather(set(acc["losses"]))))
        local = np.array([acc["losses"].get(k, 0.0) for k in names] + [acc["steps"]],
                         dtype=np.float64)
        total = comm.allreduce(local)
        train = {k: float(total[i] / max(total[-1], 1)) for i, k in enumerate(names)}
        began = time.perf_counter()
        val = self.evaluate()
        # what the epoch cost: ranks x its wall seconds (training, every session of it, and
        # validation), in GPU-hours or CPU-rank-hours
        wall = round(acc["seconds"] + time.perf_counter() - began, 3)
        split = {k: round(acc[k], 4) for k in ("compute", "allreduce", "data", "seconds")}
        per_rank = comm.gather(split, root=0)
        record = {"epoch": self.epoch + 1, "step": self.global_step, **self.scaling.lr_fields(),
                  **{f"train_{k}": v for k, v in train.items()}, **val,
                  "samples_per_s": acc["samples"] / acc["seconds"] if acc["seconds"] else None,
                  "time": split, "time_per_rank": per_rank, "ranks": self.ctx.size,
                  "wall_s": wall, "device_hours": self.ctx.size * wall / 3600,
                  "device": "gpu" if str(self.ctx.device).startswith("cuda") else "cpu"}
        if "async" in acc:
            record["async"] = acc["async"]
        record.update(self.scaling.epoch_fields(self.batch_size, self.loader.global_batch))
        return record
