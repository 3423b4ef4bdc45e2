"""Keras 3 models in the training engine (TensorFlow or torch backend).

A model file may return a :class:`KerasSupervisedTask`, or simply a compiled
``keras.Model`` (loss and optimizer from ``compile``; inputs from HDF5 key ``X``, target ``y``).
The engine then trains it exactly as a PyTorch task: same CLI, sharding, metrics, checkpoints
(the weights and optimizer variables as arrays) and ``--resume``; at the end rank 0 also saves
each model as ``models/<name>.keras`` in the run directory.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional, Union

import keras
import numpy as np

from .. import keras as mkeras
from .tasks import SupervisedTask, Task


def _arrays(variables) -> list:
    """Variables as torch tensors (a checkpoint that ``torch.load(weights_only=True)`` reads),
    without a copy, as torch's own ``state_dict`` gives them: the elastic snapshot copies
    them once (it copied twice: 36 ms against 7 ms for a 96 MiB state here). On torch the
    variable's own tensor; on TensorFlow its read value, shared through DLPack."""
    if keras.backend.backend() == "torch":
        return [v.value.detach() for v in variables]
    import tensorflow as tf
    import torch

    out = []
    for v in variables:
        value = tf.convert_to_tensor(v.value)
        try:
            out.append(torch.from_dlpack(tf.experimental.dlpack.to_dlpack(value)))
        except Exception:  # noqa: BLE001 - a dtype DLPack does not carry: one copy
            out.append(torch.from_numpy(np.asarray(value.numpy())))
    return out


def _assign(variables, values) -> None:
    for v, a in zip(variables, values):
        v.assign(a.numpy() if hasattr(a, "numpy") else a)  # numpy: older checkpoints


class KerasTask(Task):
    """The engine's Task interface for Keras models and optimizers."""

    framework = "keras"
    supports_autocast = False  # Keras: keras.mixed_precision in the model file

    def setup(self, comm, device: str, backend: str, fusion_bytes: int,
              distributed: bool = True) -> None:
        self.device = device
        if keras.backend.backend() == "tensorflow" and device.startswith("cuda"):
            raise NotImplementedError("Keras on TensorFlow here trains on CPU; use the torch "
                                      "backend (KERAS_BACKEND=torch) for GPUs")
        for name, model in self.models().items():
            mkeras.broadcast_variables(model.variables, 0, comm)
        for name, opt in self.optimizers().items():
            if not opt.built:
                opt.build(self._variables_of(name))
            mkeras.broadcast_variables(opt.variables, 0, comm)
            if distributed:
                mkeras.DistributedOptimizer(opt, comm=comm, noise_scale=self.noise_scale)
                opt._mpilearn_guard = True  # the engine's tasks stop on non-finite gradients
        self._first_streams = self.rng_state()  # rank 0's, as every rank now has them

    def _variables_of(self, optimizer_name: str) -> list:
        """What an optimizer updates: the model of the same name (tasks that name them
        differently override this)."""
        return self.models()[optimizer_name].trainable_variables

    # -- learning rates, state ---------------------------------------------------------
    def learning_rates(self) -> Dict[str, List[float]]:
        return {k: [float(keras.ops.convert_to_numpy(o.learning_rate))]
                for k, o in self.optimizers().items()}

    def set_learning_rates(self, lrs: Dict[str, List[float]]) -> None:
        for k, o in self.optimizers().items():
            o.learning_rate = lrs[k][0]

    def state_dict(self) -> dict:
        return {"models": {k: _arrays(m.weights) for k, m in self.models().items()},
                "optimizers": {k: _arrays(o.variables) for k, o in self.optimizers().items()}}

    def load_state_dict(self, state: dict) -> None:
        for k, m in self.models().items():
            _assign(m.weights, state["models"][k])
        for k, o in self.optimizers().items():
            _assign(o.variables, state["optimizers"][k])

    # -- elastic training: the survivors' models, random streams and communicator ----------
    def sync_models(self, comm, root: int = 0) -> None:
        for model in self.models().values():
            mkeras.broadcast_variables(model.weights, root, comm)
        for opt in self.optimizers().values():
            if getattr(opt, "_mpilearn_count", 0):  # backward_passes_per_step: half summed
                opt._mpilearn_acc, opt._mpilearn_count = None, 0

    def _stream_variables(self) -> list:
        """The models' seed generators (dropout's streams): in ``variables``, not ``weights``."""
        out, seen = [], set()
        for model in self.models().values():
            seen.update(id(w) for w in model.weights)
            for v in model.variables:
                if id(v) not in seen:
                    seen.add(id(v))
                    out.append(v)
        return out

    def rng_state(self):
        """The seed generators' states as lists of ints (a checkpoint's plain types)."""
        states = [np.asarray(keras.ops.convert_to_numpy(v)).tolist()
                  for v in self._stream_variables()]
        return states or None

    def set_rng_state(self, state) -> None:
        for v, value in zip(self._stream_variables(), state or ()):
            v.assign(np.asarray(value, dtype=v.dtype))

    def restart_streams(self) -> None:
        """Back to the states the set-up left (those a fresh process has: the seeds follow
        ``train.seed``), as torch's generator restarts at a resume on another rank count."""
        self.set_rng_state(getattr(self, "_first_streams", None))

    def rebind(self, comm) -> None:
        """The wrapped optimizers reduce over ``comm`` (the survivors) from the next step on."""
        from ..keras.elastic import rebind_keras

        if getattr(self, "comm", None) is not None:
            self.comm = comm
        for opt in self.optimizers().values():
            rebind_keras(None, opt, comm)

    def export(self, folder: str) -> None:
        """Rank 0 at the end: each model as ``<name>.keras`` (written atomically)."""
        os.makedirs(folder, exist_ok=True)
        for name, model in self.models().items():
            path = os.path.join(folder, f"{name}.keras")
            model.save(path + ".tmp.keras")
            os.replace(path + ".tmp.keras", path)

    # -- one optimizer step with gradients from the backend ---------------------------
    def _step(self, model, optimizer, loss_fn: Callable):
        """``loss_fn()`` returns the loss, or (loss, extra); the gradients w.r.t. ``model``'s
        trainable variables, averaged over ranks, update it. Returns the loss (or extra) as a
        backend tensor (a graph tensor inside a ``tf.function``)."""
        variables = model.trainable_variables
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                result = loss_fn()
                loss = result[0] if isinstance(result, tuple) else result
            optimizer.apply(tape.gradient(loss, variables), variables)
        else:
            import torch

            result = loss_fn()
            loss = result[0] if isinstance(result, tuple) else result
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                optimizer.apply([v.value.grad for v in variables], variables)
        out = result[1] if isinstance(result, tuple) else result
        return keras.ops.stop_gradient(out)


class KerasSupervisedTask(KerasTask, SupervisedTask):
    """``loss(model(*inputs), target)`` minimised with a Keras optimizer; metrics are
    callables ``(y_true, y_pred) -> mean`` like Keras losses. Keys, names and ``transform``
    as in :class:`SupervisedTask`."""

    def __init__(self, model, loss, optimizer, metrics: Optional[Dict[str, Callable]] = None,
                 inputs: Union[str, List[str]] = "X", target: str = "y",
                 transform: Optional[Callable[[dict], dict]] = None):
        fn = keras.losses.get(loss) if isinstance(loss, str) else loss
        SupervisedTask.__init__(self, model, lambda y, p: keras.ops.mean(fn(y, p)),  # "mse"
                                optimizer, metrics, inputs, target, transform)  # is per event

    @classmethod
    def from_compiled(cls, model) -> "KerasSupervisedTask":
        if model.optimizer is None or getattr(model, "loss", None) is None:
            raise ValueError("a Keras model returned by a model file must be compiled with a "
                             "loss and an optimizer (or return a KerasSupervisedTask)")
        return cls(model, model.loss, model.optimizer)

    def _variables_of(self, optimizer_name: str) -> list:
        return self.model.trainable_variables

    def _xs(self, batch):
        xs = [np.asarray(batch[k], dtype="float32") for k in self.inputs]
        return xs[0] if len(xs) == 1 else xs

    def train_step(self, batch):
        x, y = self._xs(batch), np.asarray(batch[self.target], dtype="float32")
        if y.ndim == 1:
            y = y[:, None]
        value = self._step(self.model, self.optimizer,
                           lambda: self.loss(y, self.model(x, training=True)))
        return {"loss": float(keras.ops.convert_to_numpy(value))}

    def eval_batch(self, batch):
        x, y = self._xs(batch), np.asarray(batch[self.target], dtype="float32")
        if y.ndim == 1:
            y = y[:, None]
        pred = self.model(x, training=False)
        n = len(y)
        out = {"loss": float(keras.ops.convert_to_numpy(self.loss(y, pred))) * n}
        for name, fn in self.metrics.items():
            out[name] = float(keras.ops.convert_to_numpy(fn(y, pred))) * n
        return out


def as_task(obj):
    """A model file's return value as an engine task (a compiled keras.Model is wrapped)."""
    if isinstance(obj, keras.Model):
        return KerasSupervisedTask.from_compiled(obj)
    return obj
