"""The 3DGAN's per-epoch physics validation, a callback its tasks declare
(``GANProtocol.callbacks``): the engine builds and runs it without knowing what it measures."""
from __future__ import annotations

import os

from ..train.callbacks import Callback
from .physics import validate_task

# the physics validation's three numbers, logged under their own names (their terms and the
# per-bin values as physics_*)
HEADLINE_PHYSICS = ("score", "score_floor", "score_ratio", "reference_metric",
                    "reference_metric_filled", "sampling_fraction_mre")


class PhysicsValidation(Callback):
    """Generated against held-out showers every ``train.validate_every`` epochs (GAN tasks):
    the project's score beside its MC-vs-MC floor and their ratio, the reference metric (exact,
    and over the cells the MC fills) and the sampling-fraction MRE, their terms, and plots in
    ``RUN/validation/epochNNNN``."""

    name = "physics"
    headline = HEADLINE_PHYSICS

    def __init__(self, task, source, events, comm, output: str, config: dict, log=None):
        self.task, self.source, self.events, self.comm = task, source, events, comm
        self.output, self.log = output, log
        self.every = config["train"]["validate_every"]
        self.max_events = config["train"]["physics_events"]

    @classmethod
    def for_trainer(cls, trainer):
        events = trainer.val_events if len(trainer.val_events) else trainer.train_events
        return cls(trainer.task, trainer.val_source, events, trainer.ctx.comm, trainer.output,
                   trainer.config, trainer.log)

    @classmethod
    def metric_names(cls, task, config):
        terms = ["moments", "profiles"] + (["angle"] if getattr(task, "variant", "") == "angle" else [])
        return ({*HEADLINE_PHYSICS, "physics_sampling_fraction_mre_error"}
                | {f"physics_{p}{t}" for p in ("", "reference_", "reference_filled_") for t in terms}
                | {f"physics_{n}_{s}" for n in ("reference_metric_filled", "sampling_fraction_mre")
                   for s in ("floor", "ratio")})

    @classmethod
    def metric_modes(cls, task, config):
        return {n: "min" for n in HEADLINE_PHYSICS}

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
        result = validate_task(self.task, self.source, self.events, self.comm, folder,
                               self.max_events, title=title)
        if self.log is not None and result.get("plots"):
            self.log.images(epoch, result["plots"])
        record.update({k if k in HEADLINE_PHYSICS else f"physics_{k}": v
                       for k, v in result.items() if not isinstance(v, (list, dict))})
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
