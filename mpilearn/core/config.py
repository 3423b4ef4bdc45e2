"""The training configuration: one YAML file, validated against a schema of defaults.

Every key has a default here, and its default's type is the type the key accepts (an int is
accepted where a float is expected). An unknown key is an error that suggests the nearest
valid one; ``--set a.b=value`` overrides parse ``value`` as YAML.
"""
from __future__ import annotations

import copy
import difflib
import os
from typing import Any, Dict, Iterable, Optional

import yaml

from ..errors import UsageError

# key -> default. ``None`` marks a key that takes a string or nothing.
SCHEMA: Dict[str, Any] = {
    "model": "",            # model file (path/to/file.py) or module, optionally ':builder'
    "hparams": {},          # free-form, passed to the builder
    "data": {
        "files": [],        # HDF5 files or glob patterns with the training events
        "val_files": [],    # validation files; if empty, val_fraction of the events is held out
        "test_files": [],   # held-out files scored once after the last epoch (test.json)
        "val_fraction": 0.1,
        "shuffle": True,
        "prefetch": 4,      # batches read ahead by the background thread
        "on_error": "stop",  # stop | skip: events whose read fails (a corrupt chunk)
    },
    "train": {
        "epochs": 1,
        "batch_size": 32,   # per rank; global batch = batch_size x ranks
        "max_steps_per_epoch": 0,   # 0 = all events; also caps validation batches per rank
        "backend": "mpi",   # mpi | torch | horovod
        "algorithm": "allreduce",   # allreduce | local_sgd | downpour | easgd (rank 0: master)
        "sync_every": 1,            # local_sgd: steps between averages; downpour/easgd: exchanges
        "elastic_force": 0.5,       # easgd: alpha, the centre's pull
        "max_staleness": 0,         # downpour: drop older gradients; 0 = 2 x workers
        "fusion_mb": 25.0,  # tensor-fusion bucket size
        "seed": 0,
        "deterministic": False,
        "precision": "fp32",          # fp32 | bf16 (autocast: bf16 matmuls/convs, fp32 weights)
        "compile": "off",             # off | default | reduce-overhead | max-autotune | ... (torch.compile)
        "channels_last": "auto",      # auto (on CUDA) | true | false: 3-D convs channels-last
        "lr_scaling": "none",        # none | linear | sqrt: lr x (global batch / base_batch)[^1/2]
        "base_batch": 0,             # global batch the lrs were tuned for; 0 = batch_size (per rank)
        "warmup_epochs": 0.0,        # linear warm-up to the scaled lr
        "early_stopping": {
            "monitor": "val_loss",
            "patience": 0,           # epochs without improvement; 0 = off
            "min_delta": 0.0,
            "mode": "",              # min | max; inferred for the project's own metrics
        },
        "best": {                    # checkpoints/best.pt and models/best/ (mpilearn.train.best)
            "monitor": "auto",       # auto (physics: sampling_fraction_mre, else val_loss) | none | a metric
            "mode": "",              # min | max; inferred for the project's own metrics
        },
        "checkpoint_every_steps": 0,  # 0 = at the end of every epoch only
        "keep_checkpoints": 3,
        "validate_every": 0,          # physics validation every N epochs (GAN tasks); 0 = off
        "physics_events": 512,        # validation events used for the physics score
        "classifier_every": 0,        # the high-level classifier AUC every N validations; 0 = off
        "log": ["jsonl"],             # + tensorboard | csv | mlflow (mpilearn.train.loggers)
        "log_every_steps": 0,         # tensorboard: training losses every N steps; 0 = off
        "elastic": {                  # a run that changes size (README "Elastic training")
            "min_ranks": 0,           # below this: checkpoint and exit 75; 0 = not elastic
            "max_ranks": 0,           # grow back up to this many; 0 = the starting size
            "batch": "rank",          # rank: per-rank batch stays, lr_scaling re-applied | global
            "snapshot_every": 1,      # steps between in-memory snapshots (ULFM; redone at a loss)
        },
        "watchdog": {                 # a rank without a step for max(floor_s, factor x its
            "enabled": True,          # median step) ends the job, its stack in the run
            "floor_s": 60.0,          # directory (mpilearn.core.watchdog)
            "factor": 10.0,
        },
    },
    "device": {
        "type": "auto",               # auto | cpu | cuda
        "allow_shared_gpus": False,   # allow more ranks per node than GPUs
    },
    "output": "",                     # run directory; default runs/<model>-<time>
}

CHOICES = {
    "search.searcher": ("gp", "evolution", "random"),
    "search.fold_mode": ("parallel", "sequential"),
    "search.pruner": ("none", "median", "asha", "hyperband"),
    "train.backend": ("mpi", "torch", "horovod"),
    "train.algorithm": ("allreduce", "local_sgd", "downpour", "easgd"),
    "train.lr_scaling": ("none", "linear", "sqrt"),
    "train.precision": ("fp32", "bf16"),
    "train.compile": ("off", "default", "reduce-overhead", "max-autotune",
                      "max-autotune-no-cudagraphs"),
    "train.channels_last": ("auto", "true", "false"),
    "device.type": ("auto", "cpu", "cuda"),
    "data.on_error": ("stop", "skip"),
    "train.best.mode": ("", "min", "max"),
    "train.elastic.batch": ("rank", "global"),
    "train.early_stopping.mode": ("", "min", "max"),
}

# YAML reads off/true/false as booleans: these keys take them as their names
BOOLEAN_NAMES = {"train.compile": {False: "off"},
                 "train.channels_last": {True: "true", False: "false"}}

FREE_FORM = {"hparams", "search.space", "search.objective", "search.options",
             "search.pruner_options"}

# an HPO sweep's config: the training config plus a 'search' section
SEARCH = {
    "searcher": "gp",          # gp | evolution | random
    "budget": 10,              # trials in the sweep (finished + failed)
    "blocks": 1,               # trials trained at once
    "folds": 2,                # k of k-fold cross-validation (1 = plain validation split)
    "ranks_per_fold": 1,
    "fold_mode": "parallel",   # parallel | sequential
    "seed": 0,
    "space": {},               # parameters, see mpilearn.hpo.space
    "objective": {},           # {metric: NAME or [NAMES], mode: final|best,
                               #  direction: minimize|maximize or one per metric}
                               # or {function: mod:func, direction: ...}
    "options": {},             # searcher options (acq_func, n_initial, population, ...)
    "trial_timeout": 0.0,      # seconds; 0 = none
    "pruner": "none",          # none | median | asha | hyperband (mpilearn.hpo.pruners)
    "pruner_options": {},      # e.g. {n_startup_trials: 5, n_warmup_steps: 0} for median
    "enqueue": [],             # points to try first: [{lr: 0.001, hidden: 32}, ...]
    "warm_start": [],          # other sweeps' run directories: their results teach the searcher
    "test_files": [],          # held-out files: never read by the search
    "elastic": False,          # ULFM (mpirun --with-ft ulfm): a lost rank ends only its block's
                               # trial, never the sweep (mpilearn-run --min-np turns it on too)
}


def _flat_keys(schema: dict, prefix: str = "") -> Iterable[str]:
    for key, value in schema.items():
        full = prefix + key
        yield full
        if isinstance(value, dict) and full not in FREE_FORM:
            yield from _flat_keys(value, full + ".")


def _type_name(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)


def _check(user: dict, schema: dict, prefix: str, source: str, root: dict = None) -> None:
    root = root or schema
    if not isinstance(user, dict):
        raise UsageError(f"{source}: '{prefix.rstrip('.') or 'config'}' must be a mapping")
    for key, value in user.items():
        full = prefix + str(key)
        if key not in schema:
            valid = list(_flat_keys(root))
            near = difflib.get_close_matches(full, valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise UsageError(f"{source}: unknown config key '{full}'{hint}")
        default = schema[key]
        if full in BOOLEAN_NAMES and isinstance(value, bool) and value in BOOLEAN_NAMES[full]:
            value = user[key] = BOOLEAN_NAMES[full][value]
        if full in FREE_FORM:
            if not isinstance(value, dict):
                raise UsageError(f"{source}: '{full}' must be a mapping")
            continue
        if isinstance(default, dict):
            _check(value, default, full + ".", source, root)
            continue
        ok = (isinstance(value, type(default))
              and not (isinstance(value, bool) and not isinstance(default, bool)))
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if isinstance(default, list) and isinstance(value, str):
            ok = True  # a single file
        if not ok:
            raise UsageError(f"{source}: '{full}' must be {_type_name(default)}, "
                             f"got {value!r}")
        if full in CHOICES and value not in CHOICES[full]:
            near = difflib.get_close_matches(str(value), CHOICES[full], n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise UsageError(f"{source}: '{full}' is {value!r}; choose one of "
                             f"{', '.join(CHOICES[full])}{hint}")


def merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key not in FREE_FORM:
            out[key] = merge(out[key], value)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_set(items: Iterable[str]) -> dict:
    """``["train.epochs=3", "hparams.lr=0.1"]`` -> nested dict."""
    out: dict = {}
    for item in items or ():
        if "=" not in item:
            raise UsageError(f"--set expects key=value, got '{item}'")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def load_file(path: str) -> dict:
    if not os.path.isfile(path):
        raise UsageError(f"config file not found: {path}")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as err:
        raise UsageError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: the top level must be a mapping of config keys")
    return data


def hpo_schema() -> dict:
    return {**SCHEMA, "search": SEARCH}


def resolve(path: Optional[str], sets: Iterable[str] = (), base: Optional[dict] = None,
            schema: Optional[dict] = None, require_model: bool = True) -> dict:
    """Defaults <- ``base`` <- file <- ``--set`` overrides, validated at each layer."""
    schema = schema or SCHEMA
    config = copy.deepcopy(schema)
    layers = []
    if base:
        layers.append((base, "default config"))
    if path:
        layers.append((load_file(path), path))
    layers.append((parse_set(sets), "--set"))
    for layer, source in layers:
        _check(layer, schema, "", source)
        config = merge(config, layer)
    for key in ("files", "val_files", "test_files"):
        if isinstance(config["data"][key], str):
            config["data"][key] = [config["data"][key]]
    if require_model and not config["model"]:
        raise UsageError("no model given: set 'model' in the config or --set model=FILE.py "
                         "(or --demo for the built-in demo job)")
    t = config["train"]
    for key in ("epochs", "batch_size", "sync_every"):
        if t[key] < 1:
            raise UsageError(f"'train.{key}' must be at least 1, got {t[key]}")
    if t["base_batch"] < 0 or t["warmup_epochs"] < 0:
        key = "base_batch" if t["base_batch"] < 0 else "warmup_epochs"
        raise UsageError(f"'train.{key}' must be at least 0, got {t[key]}")
    if "search" in config:  # a sweep: --min-np makes the sweep elastic, not its folds
        config["search"]["elastic"] = config["search"]["elastic"] or _elastic_sweep()
    else:
        _elastic_from_launcher(t["elastic"])
    _check_elastic(t["elastic"])
    if not 0 <= t["seed"] < 2 ** 32:  # numpy's seed range; torch would accept, numpy not
        raise UsageError(f"'train.seed' must be in [0, 2**32), got {t['seed']}")
    if not 0 < t["elastic_force"] <= 1:
        raise UsageError(f"'train.elastic_force' must be in (0, 1], got {t['elastic_force']}")
    if t["algorithm"] in ("downpour", "easgd") and t["lr_scaling"] != "none":
        raise UsageError(f"'train.lr_scaling: {t['lr_scaling']}' is for allreduce training; "
                         f"{t['algorithm']} applies each worker's update on its own (use none)")
    if not 0 <= config["data"]["val_fraction"] < 1:
        raise UsageError(f"'data.val_fraction' must be in [0, 1), got {config['data']['val_fraction']}")
    return config


def _elastic_from_launcher(elastic: dict) -> None:
    """``mpilearn-run --min-np M --max-np K`` hands its bounds to the ranks in the environment;
    a config that sets them keeps its own."""
    for key in ("min_ranks", "max_ranks"):
        value = os.environ.get(f"MPILEARN_ELASTIC_{key.upper()}")
        if value and not elastic[key]:
            try:
                elastic[key] = int(value)
            except ValueError:
                raise UsageError(f"MPILEARN_ELASTIC_{key.upper()}={value!r} is not a "
                                 "number") from None


def _elastic_sweep() -> bool:
    """``mpilearn-run --min-np`` in ULFM mode turns a sweep's ``search.elastic`` on: a lost
    rank costs its block's trial (in relaunch mode the job is run again instead)."""
    return bool(os.environ.get("MPILEARN_ELASTIC_MIN_RANKS")) and \
        os.environ.get("MPILEARN_ELASTIC_MODE", "ulfm") == "ulfm"


def _check_elastic(elastic: dict) -> None:
    low, high = elastic["min_ranks"], elastic["max_ranks"]
    for key, value in (("min_ranks", low), ("max_ranks", high)):
        if value < 0:
            raise UsageError(f"'train.elastic.{key}' must be at least 0, got {value}")
    if low and high and high < low:
        raise UsageError(f"'train.elastic.max_ranks' ({high}) is below 'train.elastic.min_ranks' "
                         f"({low})")


def flatten(tree: dict, prefix: str = "") -> dict:
    """Dotted keys to leaf values (lists are leaves; an empty mapping has none)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def dump(config: dict, path: str) -> None:
    from .io import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(config, sort_keys=False))
