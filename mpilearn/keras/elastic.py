"""``hvd.elastic`` of ``horovod.tensorflow.keras`` (Keras 3, TensorFlow or torch backend):
``run``, ``KerasState`` and the callbacks that keep ``state.epoch``/``state.batch`` current
and commit during ``model.fit``.

The loop is :func:`mpilearn.torch.elastic.run` (on ``mpilearn.core.membership``), shared with
the torch and TensorFlow sides; this module only says what a Keras state saves, restores and
broadcasts. Semantics as Horovod's: after a lost rank, ``run`` restores the last commit and
calls the function again, so ``fit`` runs ``epochs=total - state.epoch`` (Keras counts each
``fit`` from 0; ``UpdateEpochStateCallback`` adds the epochs done before); with
``steps_per_epoch`` set, ``UpdateBatchStateCallback`` shortens the resumed epoch by the
batches already done.
"""
from __future__ import annotations

import keras
import numpy as np

from ..torch.elastic import HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State, run
from .optimizer import broadcast_variables


def optimizer_variables(optimizer) -> list:
    """An optimizer's variables: a property in Keras 3, a method in tf.keras 2."""
    if optimizer is None:
        return []
    found = optimizer.variables
    return list(found() if callable(found) else found)


class VariablesState(ObjectState):
    """Plain values (``ObjectState``) and variables, kept as host copies at each commit and
    broadcast from rank 0 by ``sync``. Subclasses say which variables and how to broadcast."""

    def variables_to_keep(self) -> list:
        raise NotImplementedError

    def broadcast(self, variables) -> None:
        broadcast_variables(variables, root_rank=0)

    def _keep(self, variables) -> None:
        object.__setattr__(self, "_kept", [np.array(v.numpy(), copy=True) for v in variables])

    def save(self) -> None:
        self._keep(self.variables_to_keep())
        super().save()

    def restore(self) -> None:
        for var, value in zip(self.variables_to_keep(), self._kept):
            var.assign(value)
        super().restore()

    def sync(self) -> None:
        variables = self.variables_to_keep()
        if variables:
            self.broadcast(variables)
        self._keep(variables)
        super().sync()


class KerasState(VariablesState):
    """A built Keras model, its optimizer (or the one it was compiled with) and plain values
    (``epoch=0, batch=0, ...``) as one state. The optimizer's variables exist once it has
    been built (after a first step, or ``optimizer.build(model.trainable_variables)``)."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not getattr(model, "built", True):
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer or getattr(model, "optimizer", None))
        object.__setattr__(self, "backend", backend)
        super().__init__(**kwargs)
        self.save()

    def variables_to_keep(self) -> list:
        return list(self.model.variables) + optimizer_variables(self.optimizer)

    def rebind(self, comm) -> None:
        """The DistributedOptimizer reduces over the survivors' ``comm``; the model's compiled
        functions are traced again (a traced step holds the communicator it was traced with)."""
        rebind_keras(self.model, self.optimizer, comm)


def rebind_keras(model, optimizer, comm) -> None:
    settings = getattr(optimizer, "_mpilearn", None)
    if settings is not None:
        settings["comm"] = comm
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)


class CommitStateCallback(keras.callbacks.Callback):
    """``state.commit()`` every ``batches_per_commit`` batches and at each epoch's end."""

    def __init__(self, state, batches_per_commit: int = 1):
        super().__init__()
        self.state, self.batches_per_commit = state, int(batches_per_commit)
        self._left = self.batches_per_commit

    def on_train_begin(self, logs=None):
        self._left = self.batches_per_commit  # the same count on every rank after a reset

    def on_train_batch_end(self, batch, logs=None):
        self._left -= 1
        if self._left == 0:
            self.state.commit()
            self._left = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """``state.batch``: the batch just finished (0 again at an epoch's end). With
    ``steps_per_epoch``, the first epoch after a reset runs only the batches it has left."""

    def __init__(self, state):
        super().__init__()
        self.state, self._steps = state, None

    def on_train_begin(self, logs=None):
        self._steps = None

    def on_epoch_begin(self, epoch, logs=None):
        steps = (self.params or {}).get("steps")
        if steps:
            self._steps = self._steps or steps
            self.params["steps"] = self._steps - self.state.batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """``state.epoch``: the next epoch to run, counted across resets (Keras counts each
    ``fit`` from its ``initial_epoch``)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._first = state.epoch

    def on_train_begin(self, logs=None):
        self._first = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self._first + epoch + 1


__all__ = ["run", "State", "ObjectState", "KerasState", "CommitStateCallback",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "HorovodInternalError",
           "HostsUpdatedInterrupt"]
