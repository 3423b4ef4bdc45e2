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
from ..errors import TrainingStopped
from ..keras.optimizer import NONFINITE
from ..calo.gan import GANProtocol
from .tasks import SupervisedTask, Task


def _arrays(variables) -> list:
    """Variables as torch tensors: a checkpoint that ``torch.load(weights_only=True)`` reads."""
    import torch

    return [torch.from_numpy(np.array(keras.ops.convert_to_numpy(v))) for v in variables]


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
                mkeras.DistributedOptimizer(opt, comm=comm)
                opt._mpilearn_guard = True  # the engine's tasks stop on non-finite gradients

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


class KerasGANTask(GANProtocol, KerasTask):
    """The 3DGAN protocol (:class:`~mpilearn.calo.gan.GANProtocol`: 2 D + 2 G updates per
    batch, global-batch loss scaling, per-event noise and label flips, the guards) with Keras
    models: one gradient tape per update, four per batch, as in the reference TF2 loop."""

    def __init__(self, generator, discriminator, g_optimizer, d_optimizer, variant: str = "angle",
                 loss_weights=None, label_flip: float = 0.05, angle_key: str = "mtheta",
                 seed: int = 0):
        self._init_protocol(variant, loss_weights, label_flip, angle_key, seed)
        self.generator, self.discriminator = generator, discriminator
        self.g_opt, self.d_opt = g_optimizer, d_optimizer
        self.kweights = np.asarray(self.weight_values, dtype="float32")
        self.compiled = True  # TensorFlow: the four updates as one tf.function
        self._tf_updates = None

    def setup(self, comm, device, backend, fusion_bytes, distributed=True):
        super().setup(comm, device, backend, fusion_bytes, distributed)
        self.comm = comm

    def state_dict(self):
        return {**super().state_dict(), **self._gan_state()}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self._load_gan_state(state)

    def latent_input(self, noise, energy, angle):
        if self.variant == "angle":
            return keras.ops.concatenate([energy[:, None], angle[:, None], noise], axis=1)
        return energy[:, None] * noise

    def _kterms(self, outputs, label, energy, angle, ecal):
        ops = keras.ops

        def mape(y, pred):
            return 100.0 * ops.abs(y - pred) / ops.maximum(ops.abs(y), 1e-7)

        label, energy, ecal = (ops.convert_to_tensor(a) for a in (label, energy, ecal))
        p = ops.clip(outputs[0], 1e-7, 1 - 1e-7)
        terms = [-(label * ops.log(p) + (1 - label) * ops.log(1 - p)), mape(energy, outputs[1])]
        if self.variant == "angle":
            terms.append(ops.abs(ops.convert_to_tensor(angle) - outputs[2]))
        terms.append(mape(ecal, outputs[-1]))
        return ops.stack(terms, axis=1)

    def _update(self, model, opt, forward, label, targets, scale):
        """One optimizer step on (weighted terms summed over events) x scale."""
        def loss():
            terms = self._kterms(forward(), label, *targets)
            weights = keras.ops.convert_to_tensor(self.kweights)
            return keras.ops.sum(terms * weights) * scale, keras.ops.sum(terms, axis=0)

        return self._step(model, opt, loss)

    def train_step(self, batch):
        """The batch's four updates: on TensorFlow one compiled ``tf.function`` (the allreduce
        runs inside it, as a stateful op in program order), elsewhere eagerly."""
        G, D = self.generator, self.discriminator
        n_local, n_global, scale, flips, noise, sampled = self._begin_step(batch)
        if n_local == 0:  # all events filtered here: take part in the allreduces with zeros
            for model, opt in ((D, self.d_opt), (D, self.d_opt), (G, self.g_opt), (G, self.g_opt)):
                v = model.trainable_variables
                opt.apply([keras.ops.zeros_like(x) for x in v], v)
            return self._report(np.zeros((4, len(self.kweights))), n_global)
        flip = flips < self.label_flip
        inputs = (np.asarray(batch["images"], dtype="float32")[..., None],
                  np.asarray(batch["energy"], dtype="float32"),
                  np.asarray(batch["ecal"], dtype="float32"),
                  np.asarray(batch["angle"] if self.variant == "angle" else batch["energy"],
                             dtype="float32"),  # (the 25x25x25 model has no angle)
                  np.where(flip[:, 0], 0.0, 1.0).astype("float32"),  # D on real: label 1
                  np.where(flip[:, 1], 1.0, 0.0).astype("float32"),  # D on fake: label 0
                  noise, sampled, np.float32(scale))
        # an asynchronous worker's optimizer exchanges from Python inside apply(): eagerly
        eager_only = any(getattr(o, "eager_only", False) for o in (self.g_opt, self.d_opt))
        if self.compiled and not eager_only and keras.backend.backend() == "tensorflow":
            sums = self._compiled_updates(*inputs)
        else:
            sums = self._four_updates(*inputs)
        return self._report(np.asarray(keras.ops.convert_to_numpy(sums), np.float64), n_global)

    def _four_updates(self, real, energy, ecal, angle, label_real, label_fake, noise, sampled,
                      scale):
        """D on the real batch, D on a fake batch from G in inference mode, then G twice through
        D (only G's variables are updated) with label "real"; returns the (4, terms) sums."""
        G, D = self.generator, self.discriminator
        targets = (energy, angle if self.variant == "angle" else None, ecal)
        sums = [self._update(D, self.d_opt, lambda: D(real, training=True), label_real,
                             targets, scale)]
        fake_targets = self.fake_conditions(0, *targets, sampled)
        fake = G(self.latent_input(noise[0], *fake_targets[:2]), training=False)
        sums.append(self._update(D, self.d_opt, lambda: D(fake, training=True), label_fake,
                                 fake_targets, scale))
        ones = keras.ops.ones_like(label_real)
        for j in (2, 3):
            g_targets = self.fake_conditions(j - 1, *targets, sampled)
            z = self.latent_input(noise[j - 1], *g_targets[:2])
            sums.append(self._update(G, self.g_opt, lambda: D(G(z, training=True), training=True),
                                     ones, g_targets, scale))
        return keras.ops.stack(sums)

    def _compiled_updates(self, *inputs):
        import tensorflow as tf

        if self._tf_updates is None:  # one trace; the batch dimension may vary (filtered events)
            self._tf_updates = tf.function(self._four_updates, reduce_retracing=True,
                                           autograph=False)
        try:
            return self._tf_updates(*inputs)
        except tf.errors.InvalidArgumentError as err:  # the graph's finite-gradient check
            if NONFINITE in str(err):
                raise TrainingStopped(f"{NONFINITE} (Keras 3DGAN update)") from None
            raise

    def generate(self, energy_label, angle, index):
        _, noise, _ = self._draws(index, 0, purpose=1)
        e = np.asarray(energy_label, dtype="float32")
        a = np.asarray(angle, dtype="float32") if angle is not None else None
        out = self.generator(self.latent_input(noise[0], e, a), training=False)
        return np.asarray(keras.ops.convert_to_numpy(out))[..., 0]

    def discriminate(self, images):
        out = self.discriminator(np.asarray(images, dtype="float32")[..., None], training=False)
        real, aux = (np.asarray(keras.ops.convert_to_numpy(o), dtype=np.float64).reshape(-1)
                     for o in out[:2])
        return {"real": real, "energy": 100.0 * aux}

    def eval_batch(self, batch):
        D = self.discriminator
        n = len(batch["energy"])
        if n == 0:
            return {"d_loss": 0.0, "g_loss": 0.0}
        real = np.asarray(batch["images"], dtype="float32")[..., None]
        energy = np.asarray(batch["energy"], dtype="float32")
        ecal = np.asarray(batch["ecal"], dtype="float32")
        angle = np.asarray(batch["angle"], dtype="float32") if self.variant == "angle" else None
        targets = (energy, angle, ecal)
        fake = self.generate(batch["energy"], batch.get("angle"), batch["_index"])[..., None]
        ones, zeros = np.ones(n, "float32"), np.zeros(n, "float32")
        w = self.kweights

        def weighted(outputs, label):
            terms = self._kterms(outputs, label, *targets)
            return float(keras.ops.convert_to_numpy(keras.ops.sum(terms * keras.ops.convert_to_tensor(w))))

        out_fake = D(fake, training=False)
        return {"d_loss": (weighted(D(real, training=False), ones) + weighted(out_fake, zeros)) / 2,
                "g_loss": weighted(out_fake, ones)}


def as_task(obj):
    """A model file's return value as an engine task (a compiled keras.Model is wrapped)."""
    if isinstance(obj, keras.Model):
        return KerasSupervisedTask.from_compiled(obj)
    return obj
