"""Checks that run before any compute: each turns a mistake into one UsageError (exit 2, one
message from rank 0) that names the file, key or value, instead of a traceback per rank or a
failure after hours of training."""
from __future__ import annotations

import difflib
import glob
import os
import sys
import time
from typing import Iterable, Optional

from ..core import comm as mcomm
from ..data.hdf5 import EventFiles
from ..errors import UsageError


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def check_output(path: str) -> None:
    """Rank 0: the run directory is a directory we can write, or can be created."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--output {path} is a file, not a directory")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(os.path.abspath(parent))
    if not os.path.isdir(parent):
        raise UsageError(f"--output {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--output {path}: {parent} is not writable")


# what a run directory holds; --overwrite removes exactly these
RUN_OUTPUTS = ("config.yaml", "metrics.jsonl", "checkpoints", "validation", "models", "test.json",
               "launches.jsonl", "report")
# keys that a resumed run may change: how long, how often, where; not what is trained
SAFE_ON_RESUME = {"output", "train.epochs", "train.max_steps_per_epoch", "train.validate_every",
                  "train.classifier_every", "train.physics_events", "train.checkpoint_every_steps",
                  "train.keep_checkpoints", "train.early_stopping.patience",
                  "train.best.monitor", "train.best.mode", "data.test_files",
                  "train.compile", "train.channels_last",  # how it runs, not what it trains
                  "train.early_stopping.min_delta", "data.prefetch", "data.on_error",
                  "device.allow_shared_gpus", "train.log", "train.log_every_steps",
                  # how many may run it, and the batch at a size change (the checkpoint keeps
                  # the global batch it was trained with)
                  "train.elastic.min_ranks", "train.elastic.max_ranks", "train.elastic.batch",
                  "train.elastic.snapshot_every",
                  # what is measured, not what is trained (gain reads it: its lr is logged)
                  "train.noise_scale.enabled", "train.noise_scale.halves_every",
                  # an HPO fold's config carries the sweep's: these do not change its training
                  "search.budget", "search.trial_timeout", "search.enqueue", "search.warm_start",
                  "search.blocks"}


class _Unset:
    def __repr__(self):
        return "(unset)"


UNSET = _Unset()


def check_run_dir(path: str, config: dict, resume, overwrite: bool, force: bool) -> list:
    """Rank 0, before any work: a run directory that already holds a run is continued only
    with ``--resume`` (its config's changes limited to safe keys unless ``force``) and replaced
    only with ``--overwrite``. Returns the notes to print (changes accepted)."""
    present = [n for n in RUN_OUTPUTS if os.path.exists(os.path.join(path, n))]
    if not present:
        return []
    if overwrite:
        if resume:
            raise UsageError("--overwrite and --resume contradict each other: choose one")
        return []
    if not resume:
        raise UsageError(f"--output {path} already holds a run ({', '.join(present)}): continue "
                         "it with --resume (or --resume auto), or replace it with --overwrite")
    # config.yaml holds the run directory it was written in (the config's output may be '')
    return compare_saved(os.path.join(path, "config.yaml"), dict(config, output=path),
                         SAFE_ON_RESUME, force, "what is trained")


def compare_saved(saved: str, config: dict, safe: set, force: bool, what: str) -> list:
    """``--resume``: the config against the saved one. A change to a key outside ``safe`` is
    bad input unless ``force`` (the message names every changed key); returns the note that
    lists the changes accepted. Writes nothing."""
    import yaml

    from ..core.config import SCHEMA, SEARCH, flatten

    if not os.path.exists(saved):
        return []
    try:
        old = flatten(yaml.safe_load(open(saved)) or {})
    except (OSError, yaml.YAMLError) as err:
        if force:
            return [f"mpilearn: --force: {saved} unreadable ({err}); not compared"]
        raise UsageError(f"--resume: {saved} cannot be read ({err}); --force skips the check")
    new = flatten(config)
    # a key added to the schema since the run was written had its default then
    for k, v in flatten({**SCHEMA, "search": SEARCH}).items():
        if k not in old and new.get(k, UNSET) == v:
            old[k] = v
    changed = sorted(k for k in set(old) | set(new) if old.get(k, UNSET) != new.get(k, UNSET))
    described = [f"{k}: {old.get(k, UNSET)!r} -> {new.get(k, UNSET)!r}" for k in changed]
    unsafe = [d for k, d in zip(changed, described) if k not in safe]
    if unsafe and not force:
        raise UsageError(f"--resume with a config that differs from {saved} in {what}: "
                         f"{'; '.join(unsafe)}. Resume with the saved config, or add --force "
                         "to continue with the new one")
    return [f"mpilearn: resuming with a changed config: {'; '.join(described)}"] if changed else []


def clear_run_dir(path: str) -> None:
    """``--overwrite``: remove the earlier run's outputs (nothing else in the directory)."""
    import shutil

    for name in RUN_OUTPUTS:
        target = os.path.join(path, name)
        if os.path.isdir(target):
            shutil.rmtree(target)
        elif os.path.exists(target):
            os.unlink(target)


def check_hparams(model: str, hparams: dict) -> None:
    """Rank 0: a model that declares ``DEFAULTS`` takes no other hyperparameter (a typo would
    train with the default, silently), and the values it declares in ``HPARAMS`` are in range
    (``preset: smal`` would train the full model)."""
    from ..core.builders import check_values, default_hparams

    declared = default_hparams(model)
    for name in hparams if declared else ():
        if name not in declared:
            raise UsageError(f"hparams.{name}: the model {model} has no hyperparameter "
                             f"'{name}'{did_you_mean(name, declared)}; its DEFAULTS are: "
                             f"{', '.join(sorted(declared))}")
    check_values(model, hparams, declared)


def build_task(builder, spec: str, hparams: dict):
    """``builder(hparams)`` as a task; an exception or a wrong return type is bad input (the
    builder's message, with the hparams given)."""
    from .tasks import Task

    try:
        task = builder(dict(hparams))
        if "keras" in sys.modules:  # a compiled keras.Model (any subclass) becomes a task
            from .keras_tasks import as_task

            task = as_task(task)
    except UsageError:
        raise
    except Exception as err:  # the builder's own error: bad hyperparameters, most likely
        key = err.args[0] if isinstance(err, KeyError) and err.args else None
        what = f"hparams key {key!r} is missing" if key is not None else f"{type(err).__name__}: {err}"
        raise UsageError(f"model {spec}: build(hparams) failed: {what} (hparams: "
                         f"{dict(hparams)})") from None
    if not isinstance(task, Task):
        raise UsageError(f"model {spec}: build(hparams) returned {type(task).__name__}, expected "
                         "a task (SupervisedTask, GANTask, ...) or a compiled keras.Model")
    return task


def check_monitor(config: dict, task, has_validation: bool) -> dict:
    """The monitored metrics (early stopping, best checkpoint) are ones the run logs, each with
    a direction (checked before the first epoch). Returns {"early_stopping": (metric, mode) or
    None, "best": (metric, mode) or None}; ``best.monitor: auto`` becomes the metric a callback
    prefers (physics: the sampling-fraction error), else val_loss, else none."""
    from .best import resolve
    from .callbacks import DEFAULT_CALLBACKS, known_modes, logged_metrics, task_callbacks

    names = logged_metrics(task, config)
    if not has_validation:
        names = {n for n in names if not n.startswith("val_")}
    known = {n: m for n, m in known_modes(task, config).items() if n in names}
    es, best = config["train"]["early_stopping"], config["train"]["best"]
    monitor = best["monitor"]
    if monitor == "auto":
        preferred = [m for cb in (*task_callbacks(task, config), *DEFAULT_CALLBACKS)
                     if (m := cb.preferred_monitor(task, config))]
        monitor = preferred[0] if preferred else ("val_loss" if "val_loss" in names else "none")
    wanted = [("early_stopping", es["monitor"], es["mode"], es["patience"] > 0),
              ("best", monitor, best["mode"], monitor not in ("", "none"))]
    out = {"early_stopping": None, "best": None}
    for section, name, mode, on in wanted:
        if not on:
            continue
        if name not in names:
            raise UsageError(f"train.{section}.monitor '{name}' is not a metric this run logs"
                             f"{did_you_mean(name, names)}; it logs: {', '.join(sorted(names))}")
        out[section] = (name, resolve(section, name, mode, known))
    return out


def dry_run(task, files, events) -> None:
    """Rank 0, before training: one 2-event batch through a supervised model (evaluation, no
    gradient), so data that do not fit the model (feature count, target shape, dtype) are bad
    input instead of a crash at the first step. The RNG state is left as it was."""
    import numpy as np

    from . import checkpoint as ckpt
    from .tasks import SupervisedTask

    if not isinstance(task, SupervisedTask) or len(events) == 0:
        return
    state = ckpt.rng_state()
    try:
        task.eval_batch(task.transform(files.read(np.sort(np.asarray(events)[:2]))))
    except UsageError:
        raise
    except Exception as err:
        detail = " ".join(str(err).strip().splitlines()[:2])
        raise UsageError(f"the data do not fit the model: a batch of {files.paths[0]} (keys "
                         f"{', '.join(task.keys)}) raised {type(err).__name__}: {detail}") from None
    finally:
        ckpt.set_rng_state(state)


def remove_stale_temp(folders: Iterable[str]) -> list:
    """Rank 0 at start-up: ``.tmp-*`` files left by a killed atomic write."""
    removed = []
    for folder in folders:
        for path in glob.glob(os.path.join(folder, ".tmp-*")):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


def describe_missing(pattern: str) -> Optional[str]:
    """Why a data path matched no file: a directory, an unmatched glob, or missing."""
    if os.path.isdir(pattern):
        return f"{pattern} is a directory: give the files in it, e.g. {os.path.join(pattern, '*.h5')}"
    if glob.has_magic(pattern):
        return f"the pattern {pattern} matches no file"
    return None


def check_watchdog(watchdog: dict) -> None:
    """Positive bounds: a zero floor or factor would end every run at its first step."""
    for key in ("floor_s", "factor"):
        if watchdog[key] <= 0:
            raise UsageError(f"train.watchdog.{key} must be positive, not {watchdog[key]} "
                             "(set train.watchdog.enabled=false to turn the watchdog off)")


def check_precision(task, precision: str) -> None:
    """bf16 autocast is applied by the PyTorch tasks; Keras has its own policy."""
    if precision == "bf16" and not getattr(task, "supports_autocast", True):
        raise UsageError("train.precision=bf16 is for PyTorch models; for a Keras model call "
                         "keras.mixed_precision.set_global_policy('mixed_bfloat16') in its "
                         "model file and keep train.precision=fp32")


def check_framework(task, train: dict) -> None:
    """Keras tasks average their gradients in one fused mpi4py buffer per update: a
    torch.distributed or Horovod transport, or a bucket size, would silently not apply."""
    if getattr(task, "framework", "") != "keras":
        return
    if train["compile"] != "off":
        raise UsageError(f"train.compile={train['compile']} is for PyTorch models; a Keras "
                         "model compiles through its own compile(jit_compile=...)")
    if train["backend"] != "mpi":
        raise UsageError(f"train.backend={train['backend']} is for PyTorch models; a Keras "
                         "model's gradients travel through mpi4py (train.backend=mpi)")
    if train["fusion_mb"] != 25.0:
        raise UsageError(f"train.fusion_mb={train['fusion_mb']} is for PyTorch models; a Keras "
                         "model's gradients travel as one fused buffer per update")


# -- data files and devices ------------------------------------------------------------

def expand_files(patterns, key: str = "data.files") -> list:
    """The files ``patterns`` (the config's ``key``) name, globs expanded, in order."""
    out = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) or [pattern]  # a literal name: 'not found' later
        for path in matches:
            why = describe_missing(path)
            if why:  # a directory, or a pattern that matched nothing
                raise UsageError(f"{key}: {why}")
        out.extend(matches)
    return out


def open_files(config: dict, task) -> tuple:
    """Rank 0 only: check and count the data files; returns (train, val, test) files."""
    data = config["data"]
    train = EventFiles(expand_files(data["files"]), task.keys, task.optional_keys)
    val = test = None
    if data["val_files"]:
        val = EventFiles(expand_files(data["val_files"], "data.val_files"), task.keys,
                         task.optional_keys)
    if data["test_files"]:
        test = EventFiles(expand_files(data["test_files"], "data.test_files"), task.keys,
                          task.optional_keys)
        overlap = set(map(os.path.abspath, test.paths)) & set(map(os.path.abspath, train.paths))
        if overlap:
            raise UsageError(f"data.test_files also in data.files: {', '.join(sorted(overlap))}; "
                             "test events must never be trained on")
    check = getattr(task, "check_files", None)
    for files in (train, val, test):
        if check and files is not None:
            check(files)
    return train, val, test


def choose_device(ctx, config) -> tuple:
    """Collective on the node: (this rank's device, or None and why not)."""
    per_task = mcomm.gpus_are_per_task(ctx)
    shared = config["device"]["allow_shared_gpus"] or mcomm.shared_gpus_from_env()
    try:
        return mcomm.choose_device(ctx, config["device"]["type"], shared, per_task=per_task,
                                   backend=config["train"]["backend"]), None
    except UsageError as err:
        return None, f"rank {ctx.rank}: {err}"


def default_output(config: dict) -> str:
    name = os.path.splitext(os.path.basename(config["model"].split(":")[0]))[0] or "run"
    return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
