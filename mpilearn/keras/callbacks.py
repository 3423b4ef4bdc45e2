"""``hvd.callbacks``: the Keras callbacks of ``horovod.tensorflow.keras``, for Keras 3."""
from __future__ import annotations

from typing import Optional

import keras
import numpy as np


def _rank() -> int:
    from ..core import comm as _comm

    return _comm.context().rank


def _size(comm=None) -> int:
    from .optimizer import comm_of

    return comm_of(comm).Get_size()


def _no_xla(model) -> None:
    """The allreduce inside a compiled step is a tf.numpy_function, which XLA cannot compile."""
    if getattr(model, "jit_compile", False) and keras.backend.backend() == "tensorflow":
        model.jit_compile = False


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of fit(): every rank takes ``root_rank``'s weights and optimizer state."""

    def __init__(self, root_rank=0, device="", *, comm=None):
        super().__init__()
        self.root_rank, self.comm = root_rank, comm
        self.broadcast_done = False

    def set_model(self, model):
        super().set_model(model)
        _no_xla(model)

    def on_train_begin(self, logs=None):
        # a model built lazily (no Input) has no weights yet: then broadcast after the first
        # batch, as Horovod's TF2 callback always does; building the optimizer now would
        # tie it to an empty variable list
        if self.model.built and self.model.trainable_variables:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        self._broadcast()

    def _broadcast(self):
        from .optimizer import broadcast_variables

        if self.broadcast_done:
            return
        opt = self.model.optimizer
        if opt is not None and not opt.built:
            opt.build(self.model.trainable_variables)
        broadcast_variables(self.model.variables, self.root_rank, comm=self.comm)
        if opt is not None:
            broadcast_variables(opt.variables, self.root_rank, comm=self.comm)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Epoch-end metrics averaged over the ranks (so rank 0's logs speak for all). Put it
    before callbacks that read the metrics (ReduceLROnPlateau, ModelCheckpoint, ...)."""

    def __init__(self, device="", *, comm=None):
        super().__init__()
        self.comm = comm

    def set_model(self, model):
        super().set_model(model)
        _no_xla(model)

    def on_epoch_end(self, epoch, logs=None):
        from .optimizer import allreduce_arrays

        if not logs:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = allreduce_arrays([np.array([float(logs[k]) for k in names], np.float64)],
                                  self.comm)[0]
        logs.update({k: float(v) for k, v in zip(names, values)})


def _get_lr(optimizer) -> float:
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """lr = ``initial_lr`` x ``multiplier(epoch)`` from ``start_epoch`` to ``end_epoch``
    (a number ``m`` means ``m ** (epoch - start_epoch)``); once per epoch with ``staircase``,
    else every batch with a fractional epoch. ``momentum_correction`` is accepted but not
    applied: Keras 3 compiles the momentum into the train step."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr, self.start_epoch, self.end_epoch = initial_lr, start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        self.multiplier = multiplier if callable(multiplier) else (
            lambda epoch: multiplier ** (epoch - start_epoch))

    def _autodetect_steps_per_epoch(self):
        if self.params.get("steps"):
            return self.params["steps"]
        raise ValueError("Could not autodetect the number of steps per epoch. Please specify the "
                         f"steps_per_epoch parameter to the {type(self).__name__}().")

    def _adjust_learning_rate(self, epoch):
        self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.current_epoch < self.start_epoch or
                (self.end_epoch is not None and self.current_epoch >= self.end_epoch)):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's gradual warm-up (Goyal et al.): ``initial_lr`` is the *scaled* rate (usually
    base lr x size); the rate starts near ``initial_lr / size`` and reaches ``initial_lr``
    after ``warmup_epochs`` epochs."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None,
                 verbose=0, *, comm=None):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            n = _size(comm)
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and _rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_get_lr(self.model.optimizer):g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Saves the best model (by ``monitor``) on rank 0 only. Horovod leaves ``filepath`` to
    its estimators; here it is a keyword (Keras 3 wants ``.keras``)."""

    def __init__(self, monitor="val_loss", verbose=0, mode="auto", save_freq="epoch", *,
                 filepath="best_model.keras"):
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=False, mode=mode, save_freq=save_freq)

    def _save_model(self, *args, **kwargs):
        if _rank() == 0:
            return super()._save_model(*args, **kwargs)
        return None


__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "BestModelCheckpoint"]


class NoiseScaleCallback(keras.callbacks.Callback):
    """The gradient noise scale of the model's wrapped optimizer, each epoch (mpilearn's; Horovod
    has none): ``logs["critical_batch"]`` and ``logs["noise_scale_err"]`` in events, and
    ``logs["data_efficiency"]`` at the current global batch, over the epoch's steps (at least
    ``min_window``, default 50); the full estimate of each epoch in ``self.history``.
    ``batch_size``: events per rank per step. Raw noise scale only (the Keras path does not
    precondition). Measured from the gradients before and after the
    allreduce, so it needs two ranks or more."""

    def __init__(self, batch_size: int, min_window: Optional[int] = None, verbose: int = 0):
        super().__init__()
        self.batch_size, self.min_window, self.verbose = batch_size, min_window, verbose
        self.history = []

    def on_epoch_end(self, epoch, logs=None):
        noise = getattr(self.model.optimizer, "_noise", None)
        if noise is None:
            return
        noise.take_epoch(self.min_window)  # the epoch's steps, at least min_window of them
        est = noise.estimate(self.batch_size, self.batch_size * _size())
        self.history.append(est)
        if est is None or est["critical_batch"] is None or logs is None:
            return
        logs["critical_batch"] = est["critical_batch"]
        logs["noise_scale_err"] = est["critical_batch_err"]
        logs["data_efficiency"] = est["efficiency"]
        if self.verbose and _rank() == 0:
            print(f"epoch {epoch + 1}: critical batch {est['critical_batch']:.3g} events "
                  f"(data efficiency {est['efficiency']:.0%} at global batch "
                  f"{est['global_batch']})", flush=True)
