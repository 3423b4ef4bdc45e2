"""The 3DGAN protocol with Keras 3 models (TensorFlow or torch backend): the Keras twin of
:class:`~mpilearn.calo.gan.GANTask`, built by ``models/gan3d_keras.py``."""
from __future__ import annotations

import keras
import numpy as np

from ..errors import TrainingStopped
from ..keras.optimizer import NONFINITE, _checked_finite
from ..train.keras_tasks import KerasTask
from .gan import GANProtocol


class KerasGANTask(GANProtocol, KerasTask):
    """The 3DGAN protocol (:class:`~mpilearn.calo.gan.GANProtocol`: 2 D + 2 G updates per
    batch, global-batch loss scaling, per-event noise and label flips, the guards) with Keras
    models: one gradient tape per update, four per batch, as in the reference TF2 loop.

    On TensorFlow each tape is a ``mpilearn.tensorflow.DistributedGradientTape`` on the
    trainer's communicator (the whole job, or an HPO block): one reduction per update, as
    the original code's four tapes under ``tf.distribute``. ``reduction = "fused"`` (and the
    torch backend) reduce inside the wrapped Keras optimizer's ``apply`` instead."""

    reduction = "tape"

    def __init__(self, generator, discriminator, g_optimizer, d_optimizer, variant: str = "angle",
                 loss_weights=None, label_flip: float = 0.05, angle_key: str = "mtheta",
                 seed: int = 0):
        self._init_protocol(variant, loss_weights, label_flip, angle_key, seed)
        self.generator, self.discriminator = generator, discriminator
        self.g_opt, self.d_opt = g_optimizer, d_optimizer
        self.floatx = keras.config.floatx()  # float64 for the exactness tests
        self.kweights = np.asarray(self.weight_values, dtype=self.floatx)
        self.compiled = True  # TensorFlow: the four updates as one tf.function
        self._tf_updates = None

    def setup(self, comm, device, backend, fusion_bytes, distributed=True):
        self.tapes = self.reduction == "tape" and keras.backend.backend() == "tensorflow"
        # the tapes reduce: the optimizers are then left plain (only broadcast and built)
        super().setup(comm, device, backend, fusion_bytes, distributed and not self.tapes)
        self.comm = comm
        self.tape_comm = comm if distributed and self.tapes else None

    def rebind(self, comm) -> None:
        """The tapes reduce over ``comm`` too; the compiled updates, traced with the old
        communicator inside them, are traced again."""
        super().rebind(comm)
        if self.tape_comm is not None:
            self.tape_comm = comm
        self._tf_updates = None

    def allreduce_seconds(self) -> float:
        seconds = super().allreduce_seconds()
        if getattr(self, "tapes", False):
            from ..tensorflow.mpi_ops import pop_allreduce_seconds

            seconds += pop_allreduce_seconds()
        return seconds

    def _tape_step(self, model, opt, loss_fn):
        """One update: a tape whose gradients are averaged over the trainer's ranks, checked
        to be finite (alike on every rank, so every rank stops together), then applied."""
        import tensorflow as tf

        from .. import tensorflow as hvd

        variables = model.trainable_variables
        with tf.GradientTape() as tape:
            loss, sums = loss_fn()
        if self.tape_comm is not None:
            tape = hvd.DistributedGradientTape(tape, comm=self.tape_comm)
        grads = tape.gradient(loss, variables)
        if self.tape_comm is not None:
            grads = _checked_finite(grads)
        opt.apply(grads, variables)
        return tf.stop_gradient(sums)

    def _empty_update(self, model, opt):
        """A rank without events this step: zero gradients into the same reduction."""
        if not self.tapes:
            v = model.trainable_variables
            opt.apply([keras.ops.zeros_like(x) for x in v], v)
            return
        import tensorflow as tf

        def nothing():
            zero = tf.add_n([tf.reduce_sum(v) for v in model.trainable_variables]) * 0.0
            return zero, zero

        self._tape_step(model, opt, nothing)

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

        if self.tapes:
            return self._tape_step(model, opt, loss)
        return self._step(model, opt, loss)

    def train_step(self, batch):
        """The batch's four updates: on TensorFlow one compiled ``tf.function`` (the allreduce
        runs inside it, as a stateful op in program order), elsewhere eagerly."""
        G, D = self.generator, self.discriminator
        n_local, n_global, scale, flips, noise, sampled = self._begin_step(batch)
        if n_local == 0:  # all events filtered here: take part in the allreduces with zeros
            for model, opt in ((D, self.d_opt), (D, self.d_opt), (G, self.g_opt), (G, self.g_opt)):
                self._empty_update(model, opt)
            return self._report(np.zeros((4, len(self.kweights))), n_global)
        flip = flips < self.label_flip
        fx = self.floatx
        inputs = (np.asarray(batch["images"], dtype=fx)[..., None],
                  np.asarray(batch["energy"], dtype=fx),
                  np.asarray(batch["ecal"], dtype=fx),
                  np.asarray(batch["angle"] if self.variant == "angle" else batch["energy"],
                             dtype=fx),  # (the 25x25x25 model has no angle)
                  np.where(flip[:, 0], 0.0, 1.0).astype(fx),  # D on real: label 1
                  np.where(flip[:, 1], 1.0, 0.0).astype(fx),  # D on fake: label 0
                  np.asarray(noise, dtype=fx), np.asarray(sampled, dtype=fx), np.dtype(fx).type(scale))
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
        e = np.asarray(energy_label, dtype="float32")
        a = np.asarray(angle, dtype="float32") if angle is not None else None
        out = self.generator(self.latent_input(self.generation_noise(index), e, a), training=False)
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
