"""The 3DGAN's per-epoch physics validation, a callback its tasks declare
(``GANProtocol.callbacks``): the engine builds and runs it without knowing what it measures."""
from __future__ import annotations

import os

from ..train.callbacks import Callback
from .physics import FLOORED, SIGMA, beside_floor, validate_task

# every number with an MC-vs-MC floor is logged under validate's own name (``FLOORED``, and
# its _floor, _error, _floor_error and _ratio, or _sigma for a floor 0 within its error:
# ``physics.SIGMA``), so that one name serves validate's JSON, the epoch record,
# best-checkpoint monitors and HPO objectives; the terms and per-bin values as physics_*
FLOORED_NAMES = tuple(f"{n}{s}" for n in FLOORED
                      for s in ("", "_floor", beside_floor(n), "_error", "_floor_error"))
HEADLINE_PHYSICS = ("score", "reference_metric", "reference_metric_filled",
                    "sampling_fraction_mre", "fpd", "kpd", "separation_power", "auc_high")
# the epoch line shows these beside their floors (``beside``; the full record is in metrics.jsonl)
SHOWN = ("score", "sampling_fraction_mre", "fpd", "kpd", "auc_high")
LOWER_IS_BETTER = {n: "min" for n in FLOORED_NAMES if not n.endswith("error")}


def record_name(key: str) -> str:
    """The epoch record's name of validate's result ``key``."""
    if key == "events":
        return "physics_events"
    return key if key in FLOORED_NAMES or key == "reference_metric" else f"physics_{key}"


def sigmas(value: float) -> str:
    """A distance in standard deviations: ``0.8 σ``, ``12 σ``, ``3 700 σ``."""
    if abs(value) < 10:
        return f"{value:.1f} σ"
    digits = max(0, len(str(int(abs(value)))) - 2)   # two significant digits, grouped
    return f"{round(value, -digits):,.0f}".replace(",", " ") + " σ"


def plus_minus(value: float, error) -> str:
    """``0.0000 ± 0.022``: the value to four decimals (two significant digits below 0.001)."""
    if error is None:
        return f"{value:.4g}"
    if abs(error) >= 1e-3 or error == 0:
        return f"{value:.4f} ± {error:.2g}"
    return f"{value:.2g} ± {error:.2g}"


def beside(record: dict, name: str) -> str:
    """How ``record[name]`` compares with its MC-vs-MC floor, in the words used everywhere:
    ``3 700 σ; MC floor 0.0000 ± 0.022`` where the floor is 0 within its error (FPD, KPD),
    ``3.2x floor`` where it is a number; '' without a floor."""
    if name in SIGMA:
        sigma, floor = record.get(f"{name}_sigma"), record.get(f"{name}_floor")
        if sigma is None or floor is None:
            return ""
        return f"{sigmas(sigma)}; MC floor {plus_minus(floor, record.get(name + '_floor_error'))}"
    ratio = record.get(f"{name}_ratio")
    return "" if ratio is None else f"{ratio:.3g}x floor"


def short_line(record: dict, names=SHOWN) -> str:
    """``name value (ratio x floor)``, or ``name value (N σ; MC floor F ± E)``, for the
    headline numbers present in ``record``."""
    parts = []
    for name in names:
        value = record.get(name)
        if value is None:
            continue
        text = beside(record, name)
        parts.append(f"{name} {value:.4g}" + (f" ({text})" if text else ""))
    return ", ".join(parts)


class PhysicsValidation(Callback):
    """Generated against held-out showers every ``train.validate_every`` epochs (GAN tasks):
    the project's score, the reference metric (exact, and over the cells the MC fills), the
    sampling-fraction MRE and the CaloChallenge's FPD, KPD and separation power, each beside
    its MC-vs-MC floor and their ratio (FPD, KPD: the distance from it in σ); the high-level classifier AUC every
    ``train.classifier_every`` validated epochs (0: never; it trains 2 x 5 small MLPs); plots
    in ``RUN/validation/epochNNNN``."""

    name = "physics"
    headline = ()   # the epoch line shows ``short_line`` instead of raw values
    summary = staticmethod(short_line)

    def __init__(self, task, source, events, comm, output: str, config: dict, log=None):
        self.task, self.source, self.events, self.comm = task, source, events, comm
        self.output, self.log = output, log
        self.every = config["train"]["validate_every"]
        self.classifier_every = config["train"].get("classifier_every", 0)
        self.max_events = config["train"]["physics_events"]

    @classmethod
    def for_trainer(cls, trainer):
        events = trainer.val_events if len(trainer.val_events) else trainer.train_events
        return cls(trainer.task, trainer.val_source, events, trainer.ctx.comm, trainer.output,
                   trainer.config, trainer.log)

    @classmethod
    def metric_names(cls, task, config):
        terms = ["moments", "profiles"] + (["angle"] if getattr(task, "variant", "") == "angle" else [])
        floored = [n for n in FLOORED_NAMES
                   if not n.startswith("auc_high") or config["train"].get("classifier_every")]
        return ({*floored, "reference_metric"}
                | {f"physics_{p}{t}" for p in ("", "reference_", "reference_filled_") for t in terms})

    @classmethod
    def metric_modes(cls, task, config):
        return {**LOWER_IS_BETTER, "reference_metric": "min"}

    @classmethod
    def preferred_monitor(cls, task, config):
        # the reference picks its epoch by the sampling-fraction error (SelectEpoch)
        return "sampling_fraction_mre"

    def on_epoch_end(self, record):
        epoch = record["epoch"]
        if epoch % self.every:
            return False
        folder = os.path.join(self.output, "validation", f"epoch{epoch:04d}")
        title = f"run {os.path.basename(os.path.abspath(self.output))} epoch {epoch}"
        validated = epoch // self.every
        classifier = bool(self.classifier_every) and validated % self.classifier_every == 0
        result = validate_task(self.task, self.source, self.events, self.comm, folder,
                               self.max_events, title=title, classifier=classifier)
        if self.log is not None and result.get("plots"):
            self.log.images(epoch, result["plots"])
        record.update({record_name(k): v for k, v in result.items()
                       if not isinstance(v, (list, dict))})
        return False


class TrainingRanges(Callback):
    """Records the training files' energy and angle ranges in ``RUN/training_ranges.json``
    (rank 0, when training starts): what ``generate`` checks conditions against and ``export``
    writes beside the model."""

    name = "training_ranges"

    @classmethod
    def for_trainer(cls, trainer):
        if trainer.ctx.rank == 0:
            from . import ranges

            ranges.write(trainer.task, trainer.train_files.paths, trainer.output)
        return cls()
