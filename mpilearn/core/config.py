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

# key -> default (its type is the type the key accepts); each key's meaning is in
# DESCRIPTIONS below, which --help and the docs' reference read (a test checks that
# every key has one)
SCHEMA: Dict[str, Any] = {
    "model": "",
    "hparams": {},
    "data": {
        "files": [],
        "val_files": [],
        "test_files": [],
        "val_fraction": 0.1,
        "shuffle": True,
        "prefetch": 4,
        "on_error": "stop",
    },
    "train": {
        "epochs": 1,
        "batch_size": 32,
        "max_steps_per_epoch": 0,
        "backend": "mpi",
        "algorithm": "allreduce",
        "sync_every": 1,
        "elastic_force": 0.5,
        "max_staleness": 0,
        "fusion_mb": 25.0,
        "seed": 0,
        "deterministic": False,
        "precision": "fp32",
        "compile": "off",
        "channels_last": "auto",
        "lr_scaling": "auto",
        "base_batch": 0,
        "warmup_epochs": 0.0,
        "noise_scale": {
            "enabled": True,
            "halves_every": 16,
        },
        "early_stopping": {
            "monitor": "val_loss",
            "patience": 0,
            "min_delta": 0.0,
            "mode": "",
        },
        "best": {
            "monitor": "auto",
            "mode": "",
        },
        "checkpoint_every_steps": 0,
        "keep_checkpoints": 3,
        "validate_every": 0,
        "physics_events": 512,
        "classifier_every": 0,
        "log": ["jsonl"],
        "log_every_steps": 0,
        "elastic": {
            "min_ranks": 0,
            "max_ranks": 0,
            "batch": "rank",
            "snapshot_every": 1,
        },
        "watchdog": {
            "enabled": True,
            "floor_s": 60.0,
            "factor": 10.0,
        },
    },
    "device": {
        "type": "auto",
        "allow_shared_gpus": False,
    },
    "output": "",
}

CHOICES = {
    "search.searcher": ("auto", "gp", "evolution", "random", "forest"),
    "search.fold_mode": ("parallel", "sequential"),
    "search.pruner": ("none", "median", "asha", "hyperband"),
    "train.backend": ("mpi", "torch", "horovod"),
    "train.algorithm": ("allreduce", "local_sgd", "downpour", "easgd"),
    "train.lr_scaling": ("auto", "sqrt", "linear", "srsr", "gain", "none"),
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
    "searcher": "auto",
    "budget": 10,
    "blocks": 1,
    "folds": 2,
    "ranks_per_fold": 1,
    "fold_mode": "parallel",
    "seed": 0,
    "space": {},
    "objective": {},
    "options": {},
    "trial_timeout": 0.0,
    "pruner": "none",
    "pruner_options": {},
    "enqueue": [],
    "warm_start": [],
    "test_files": [],
    "elastic": False,
}

# dotted key -> its meaning: the one source of `python -m mpilearn.train --help`'s key list, of
# `python -m mpilearn.optimize --help`'s search keys and of the docs' config reference (a key's
# choices and default are added from CHOICES and the schema). A key added to SCHEMA or SEARCH
# needs a line here (tests/test_config.py).
DESCRIPTIONS: Dict[str, str] = {
    "model": "model file `path/to/file.py` or module, optionally `:builder` (default builder "
             "`build`); required",
    "hparams": "free-form mapping passed to the builder (a model file's `DEFAULTS` fill the rest)",
    "data.files": "HDF5 files or glob patterns with the training events",
    "data.val_files": "validation files; if empty, `data.val_fraction` of the events is held "
                      "out (a fixed, seeded split)",
    "data.test_files": "held-out files (never in `data.files`), scored once after the last "
                       "epoch: `test_*` in `RUN/test.json` and a `{\"test\": ...}` line in "
                       "`metrics.jsonl`",
    "data.val_fraction": "share of the events held out for validation when there are no "
                         "`data.val_files`",
    "data.shuffle": "per-epoch seeded shuffling of the events",
    "data.prefetch": "batches read ahead by a background thread",
    "data.on_error": "a read that fails mid-run (a corrupt chunk): `stop` ends the job at that "
                     "step on every rank with one message naming the file, dataset, events and "
                     "ranks (exit 3, resumable); `skip` drops those events, warns once and "
                     "trains on",
    "train.epochs": "epochs to train (a resumed run trains up to this many in all)",
    "train.batch_size": "batch size per rank: the global batch is batch_size x ranks",
    "train.max_steps_per_epoch": "cap on an epoch's steps and on the validation batches per "
                                 "rank; 0 = all events",
    "train.backend": "gradient transport: mpi (mpi4py), torch (torch.distributed: gloo on CPU, "
                     "NCCL on GPU), horovod",
    "train.algorithm": "how the ranks combine updates: allreduce, local_sgd, or master/worker "
                       "downpour / easgd (rank 0 is the master)",
    "train.sync_every": "local_sgd: steps between averages; downpour/easgd: steps between "
                        "exchanges with the master",
    "train.elastic_force": "easgd: alpha, the centre's pull, in (0, 1]",
    "train.max_staleness": "downpour: gradients older than this many centre updates are "
                           "dropped; 0 = 2 x workers",
    "train.fusion_mb": "tensor-fusion bucket size in MB",
    "train.seed": "seed of the data order, initialisation and per-event randomness",
    "train.deterministic": "deterministic kernels (also turns cuDNN autotuning off)",
    "train.precision": "bf16: forward passes under torch.autocast (weights, gradients and "
                       "allreduce stay fp32); PyTorch models only",
    "train.compile": "a torch.compile mode, each model compiled in place (module.compile); the "
                     "allreduce hooks stay outside the graphs and checkpoints keep plain keys; "
                     "PyTorch models only",
    "train.channels_last": "3-D (2-D) convolution weights channels-last; auto = on CUDA only",
    "train.lr_scaling": "each optimizer's lr for k = global batch / train.base_batch: auto = "
                        "sqrt for adaptive optimizers (RMSprop, Adam, ...), linear for SGD; "
                        "sqrt = lr x sqrt(k); linear = lr x k; srsr = Malladi's rule (lr x "
                        "sqrt(k), each 1-beta x k, eps / sqrt(k)); gain = AdaScale's gain "
                        "ratio from the measured noise scale; none; re-applied at a size "
                        "change, and --resume continues it exactly",
    "train.base_batch": "the global batch the lrs were tuned for; 0 = train.batch_size (so "
                        "linear is lr x ranks)",
    "train.warmup_epochs": "epochs over which the lr ramps step by step to the scaled lr",
    "train.noise_scale": "the gradient noise scale of each optimizer (McCandlish et al. 2018), "
                         "from the gradients before and after the allreduce; in metrics.jsonl "
                         "and one line at the end of the run",
    "train.noise_scale.enabled": "measure it on every allreduce step (two squared norms per "
                                 "bucket and one 2-element allreduce)",
    "train.noise_scale.halves_every": "at one rank: measure it from the two halves of every "
                                      "Nth batch (one more backward pass of half a batch); "
                                      "0 = off",
    "train.early_stopping.monitor": "metric early stopping watches",
    "train.early_stopping.patience": "epochs without an improvement of more than min_delta "
                                     "before stopping; 0 = off",
    "train.early_stopping.min_delta": "the smallest change that counts as an improvement",
    "train.early_stopping.mode": "min or max: which way the monitor improves; inferred for "
                                 "the project's own metrics",
    "train.best.monitor": "the best epoch's checkpoint (checkpoints/best.pt) and models "
                          "(models/best/): auto = sampling_fraction_mre where physics "
                          "validation runs, else val_loss where the run validates; none = off; "
                          "or a metric",
    "train.best.mode": "min or max: which way the monitor improves; inferred for the "
                       "project's own metrics",
    "train.checkpoint_every_steps": "steps between mid-epoch checkpoints; 0 = at epoch ends "
                                    "only",
    "train.keep_checkpoints": "checkpoints kept (best.pt is never pruned)",
    "train.validate_every": "physics validation of GAN tasks every N epochs; 0 = off",
    "train.physics_events": "validation events used for the physics score",
    "train.classifier_every": "the high-level classifier AUC every N physics validations; "
                              "0 = off",
    "train.log": "metric sinks: jsonl (always), tensorboard (RUN/tensorboard/), csv "
                 "(RUN/metrics.csv), mlflow (when installed)",
    "train.log_every_steps": "tensorboard: the training losses every N steps; 0 = off",
    "train.elastic.min_ranks": "an elastic run: below this many ranks, checkpoint and exit 75; "
                               "0 = not elastic",
    "train.elastic.max_ranks": "an elastic run grows back up to this many ranks; 0 = the "
                               "starting size",
    "train.elastic.batch": "at another rank count keep the per-rank batch (rank: lr_scaling "
                           "applied again) or the global batch (global)",
    "train.elastic.snapshot_every": "steps between in-memory snapshots (ULFM: a lost rank "
                                    "redoes the steps since; local_sgd: at its averages)",
    "train.watchdog.enabled": "a rank that finishes no step for max(floor_s, factor x its "
                              "median step) ends the job with exit 124, every thread's stack "
                              "in RUN/watchdog-rankR.txt",
    "train.watchdog.floor_s": "the watchdog's shortest patience, in seconds",
    "train.watchdog.factor": "the watchdog's patience in median steps",
    "device.type": "where each rank computes; auto = one GPU per node-local rank where there "
                   "are GPUs, else the CPU",
    "device.allow_shared_gpus": "allow more ranks per node than GPUs",
    "output": "run directory; default runs/<model>-<time> (--output overrides it)",
    "search.searcher": "auto (gp for one objective at every size, evolution for several; "
                       "the choice is written to config.yaml), "
                       "gp (scikit-optimize's GP, batches by kriging believer), evolution (DEAP: "
                       "steady state, NSGA-II with several objectives), random, forest (extra "
                       "trees, a UCB weight drawn per suggestion, refits off the asks)",
    "search.budget": "trials in the sweep (done + pruned + failed)",
    "search.blocks": "trials trained at once",
    "search.folds": "k of k-fold cross-validation at event level (1 = a plain validation split)",
    "search.ranks_per_fold": "ranks that train one fold",
    "search.fold_mode": "a trial's folds side by side (parallel: np = 1 + blocks x folds x "
                        "ranks_per_fold) or one after another (sequential)",
    "search.seed": "seed of the searcher and of the folds' split",
    "search.space": "name: {type: real|int|categorical, low, high, log, choices, default}; "
                    "dotted names reach into hparams",
    "search.objective": "{metric: NAME or [NAMES], mode: final|best, direction: "
                        "minimize|maximize or one per metric}, or {function: module:func}",
    "search.options": "searcher options (gp: acq_func, n_initial, xi, kappa, ...; evolution: "
                      "population, tournament, crossover, ...; forest: n_initial, kappa, "
                      "trees, min_leaf, ...)",
    "search.trial_timeout": "seconds a trial may train; 0 = no limit",
    "search.pruner": "stop unpromising trials early (Optuna's rules and defaults)",
    "search.pruner_options": "the pruner's options, e.g. {n_startup_trials: 5} for median",
    "search.enqueue": "points to try first, before the searcher's own: [{lr: 0.001, hidden: 32}]",
    "search.warm_start": "other sweeps' run directories: their results teach the searcher",
    "search.test_files": "held-out files, never read by the search; the refit scores them",
    "search.elastic": "ULFM (mpirun --with-ft ulfm): a lost rank ends only its block's trial, "
                      "never the sweep (mpilearn-run --min-np turns it on too)",
}


def _flat_keys(schema: dict, prefix: str = "") -> Iterable[str]:
    for key, value in schema.items():
        full = prefix + key
        yield full
        if isinstance(value, dict) and full not in FREE_FORM:
            yield from _flat_keys(value, full + ".")


def documented_keys(schema: Optional[dict] = None, prefix: str = "") -> Iterable[tuple]:
    """(dotted key, default) of every key a user sets: the schema's leaves, a free-form
    mapping (``hparams``, ``search.space``) as one key."""
    for key, value in (schema if schema is not None else hpo_schema()).items():
        full = prefix + key
        if isinstance(value, dict) and value and full not in FREE_FORM:
            yield from documented_keys(value, full + ".")
        else:
            yield full, value


def show_default(value) -> str:
    """A default as YAML writes it (``''`` for an empty string)."""
    if isinstance(value, str) and not value:
        return "''"
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()


def meaning(key: str) -> str:
    """The key's description with its choices."""
    text = DESCRIPTIONS[key]
    if key in CHOICES:
        text += " (one of: " + ", ".join(c or "''" for c in CHOICES[key]) + ")"
    return text


def help_keys(schema: Optional[dict] = None, width: int = 100) -> str:
    """The key list of a command's --help: one key a line, its default, its meaning."""
    import textwrap

    lines = []
    for key, default in documented_keys(schema if schema is not None else SCHEMA):
        head = f"  {key:<32} {show_default(default):<10} "
        if len(head) > 46:
            head = f"  {key} = {show_default(default)} "
        wrapped = textwrap.wrap(meaning(key).replace("`", ""), width - 46) or [""]
        lines.append(f"{head:<46}{wrapped[0]}")
        lines += [" " * 46 + more for more in wrapped[1:]]
    return "\n".join(lines)


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
    if t["algorithm"] in ("downpour", "easgd") and t["lr_scaling"] not in ("auto", "none"):
        raise UsageError(f"'train.lr_scaling: {t['lr_scaling']}' is for allreduce training; "
                         f"{t['algorithm']} applies each worker's update on its own (use auto "
                         "or none: the configured rate)")
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
