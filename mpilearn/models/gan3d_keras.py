"""3DGAN in Keras 3, built like the Keras reference (reference 3dgan.md §1), layer for layer the
same as models/gan3d.py (PyTorch), so weights move between the two with :func:`from_torch`.

Channels-last: G maps a latent vector to (N, X, Y, Z, 1); D maps (N, X, Y, Z, 1) to
(P(real), E/100, [measured angle], cell sum). Variants and presets as in gan3d.py:
angle (G 1 364 983 / D 87 354 trainable), fixed (G 872 808 / D 73 402), angle small.
Keras defaults the reference relies on are set explicitly: LeakyReLU 0.3, BN momentum 0.99 and
epsilon 1e-6, nearest up-sampling, "same" padding, he_uniform G convs, glorot_normal last conv.
"""
import math

import keras
import numpy as np
from keras import layers, ops

from mpilearn.calo.format import EMPTY_ANGLE, MIN_LAYER_ENERGY, POWER  # shared by both twins
from mpilearn.calo.gan import build_networks

DEFAULTS = {"variant": "angle", "preset": "full", "dropout": 0.2, "batch_norm": True,
            "lr": 1e-3, "loss_weights": None, "label_flip": 0.05, "angle_key": "mtheta",
            "seed": 0, "reduction": "tape"}
HPARAMS = {"variant": ["angle", "fixed"], "preset": ["full", "small"], "lr": "[0, inf)",
           "label_flip": "[0, 1]", "dropout": "[0, 1)", "batch_norm": [True, False],
           "angle_key": ["mtheta", "theta"], "seed": "int [0, inf)",
           "reduction": ["tape", "fused"]}


def measured_angle(images):
    """§4c in keras.ops, as mpilearn.calo.format.measured_angle: (N, X, Y, Z) raw energies."""
    _, nx, ny, nz = images.shape
    dt = images.dtype
    xs = ops.arange(nx, dtype=dt) + 0.5
    ys = ops.arange(ny, dtype=dt) + 0.5
    zs = ops.arange(nz, dtype=dt) + 0.5
    total = ops.sum(images, axis=(1, 2, 3))
    safe_total = ops.where(total > MIN_LAYER_ENERGY, total, ops.ones_like(total))
    x_ref = ops.sum(ops.sum(images, axis=(2, 3)) * xs, axis=1) / safe_total
    y_ref = ops.sum(ops.sum(images, axis=(1, 3)) * ys, axis=1) / safe_total
    z_ref = ops.sum(ops.sum(images, axis=(1, 2)) * zs, axis=1) / safe_total
    layer = ops.sum(images, axis=(1, 2))
    filled = layer > MIN_LAYER_ENERGY
    safe_layer = ops.where(filled, layer, ops.ones_like(layer))
    x_mid = ops.sum(ops.sum(images, axis=2) * xs[:, None], axis=1) / safe_layer
    y_mid = ops.sum(ops.sum(images, axis=1) * ys[:, None], axis=1) / safe_layer
    dz = zs[None, :] - z_ref[:, None]
    dist2 = (x_mid - x_ref[:, None]) ** 2 + dz ** 2
    dist = ops.sqrt(ops.where(dist2 > 1e-12, dist2, ops.ones_like(dist2)))
    slope = (y_mid - y_ref[:, None]) / dist
    slope = ops.where(dz < 0, -slope, slope)
    angle = math.pi / 2 - ops.arctan(slope)
    weight = zs[None, :] * ops.cast(filled, dt)
    wsum = ops.sum(weight, axis=1)
    mean = ops.sum(angle * weight, axis=1) / ops.where(wsum > 0, wsum, ops.ones_like(wsum))
    return ops.where(wsum > 0, mean, ops.full_like(mean, EMPTY_ANGLE))


def _act(kind):
    return layers.ReLU() if kind == "relu" else layers.LeakyReLU(negative_slope=0.3)


def _block(x, filters, kernel, pad, act, bn, init="glorot_uniform", dropout=0.0):
    """pad: None (valid), "same", or (x, y, z) zeros on both sides."""
    if isinstance(pad, tuple):
        x = layers.ZeroPadding3D(tuple((p, p) for p in pad))(x)
    x = layers.Conv3D(filters, kernel, padding="same" if pad == "same" else "valid",
                      kernel_initializer=init)(x)
    x = _act(act)(x)
    if bn:
        x = layers.BatchNormalization(momentum=0.99, epsilon=1e-6)(x)
    if dropout:
        x = layers.Dropout(dropout)(x)
    return x


def _generator(latent, seed_shape, channels, body, last_kernel=2, last_bias=True, name="generator"):
    z = keras.Input((latent,))
    x = layers.Dense(int(math.prod(seed_shape)) * channels)(z)
    x = layers.Reshape((*seed_shape, channels))(x)
    x = body(x)
    x = layers.Conv3D(1, last_kernel, use_bias=last_bias, kernel_initializer="glorot_normal")(x)
    return keras.Model(z, layers.ReLU()(x), name=name)


def _discriminator(shape, body, variant, name="discriminator"):
    image = keras.Input((*shape, 1))
    h = layers.Flatten()(body(image))
    real = layers.Dense(1, activation="sigmoid")(h)
    aux = layers.Dense(1)(h)
    outs = [layers.Reshape(())(real), layers.Reshape(())(aux)]
    if variant == "fixed":
        outs.append(layers.Lambda(lambda x: ops.sum(x, axis=(1, 2, 3, 4)))(image))
    else:
        raw = layers.Lambda(lambda x: ops.power(ops.maximum(x[..., 0], 0.0), 1.0 / POWER))(image)
        outs += [layers.Lambda(measured_angle)(raw), layers.Lambda(lambda r: ops.sum(r, axis=(1, 2, 3)))(raw)]
    return keras.Model(image, outs, name=name)


def angle_models(bn=True, dropout=0.2):
    def g_body(x):
        x = layers.UpSampling3D(6)(x)
        x = _block(x, 8, (6, 6, 8), None, "relu", bn, "he_uniform")
        for _ in range(3):
            x = _block(x, 6, (4, 4, 6), (2, 2, 1), "relu", bn, "he_uniform")
        x = _block(x, 6, (3, 3, 5), (1, 1, 0), "relu", bn, "he_uniform")
        return _block(x, 6, (3, 3, 3), (1, 1, 0), "relu", False, "he_uniform")

    def d_body(x):
        x = _block(x, 16, (5, 6, 6), "same", "leaky", False, dropout=dropout)
        x = _block(x, 8, (5, 6, 6), (0, 0, 1), "leaky", bn, dropout=dropout)
        x = _block(x, 8, (5, 6, 6), (0, 0, 1), "leaky", bn, dropout=dropout)
        x = _block(x, 8, (5, 6, 6), None, "leaky", bn, dropout=dropout)
        return layers.AveragePooling3D(2)(x)

    return _generator(256, (9, 9, 8), 8, g_body), _discriminator((51, 51, 25), d_body, "angle")


def small_angle_models(bn=True, dropout=0.2):
    def g_body(x):
        x = layers.UpSampling3D((6, 6, 5))(x)
        return _block(x, 2, (4, 4, 3), (0, 0, 1), "relu", bn, "he_uniform")

    def d_body(x):
        x = layers.AveragePooling3D(2)(x)
        x = _block(x, 8, (3, 3, 3), "same", "leaky", False, dropout=dropout)
        x = layers.AveragePooling3D(2)(x)
        return _block(x, 8, (3, 3, 3), None, "leaky", bn, dropout=dropout)

    return (_generator(256, (9, 9, 5), 2, g_body, last_kernel=1),
            _discriminator((51, 51, 25), d_body, "angle"))


def fixed_models(bn=True, dropout=0.2):
    def g_body(x):
        x = _block(x, 64, (6, 6, 8), "same", "leaky", bn, "he_uniform")
        x = layers.UpSampling3D(2)(x)
        x = _block(x, 6, (6, 5, 8), (2, 2, 0), "leaky", bn, "he_uniform")
        x = layers.UpSampling3D((2, 2, 3))(x)
        return _block(x, 6, (3, 3, 8), (1, 0, 3), "leaky", False, "he_uniform")

    def d_body(x):
        x = _block(x, 32, (5, 5, 5), "same", "leaky", False, dropout=dropout)
        x = _block(x, 8, (5, 5, 5), (2, 2, 2), "leaky", bn, dropout=dropout)
        x = _block(x, 8, (5, 5, 5), (2, 2, 2), "leaky", bn, dropout=dropout)
        x = _block(x, 8, (5, 5, 5), (1, 1, 1), "leaky", bn, dropout=dropout)
        return layers.AveragePooling3D(2)(x)

    return (_generator(200, (7, 7, 8), 8, g_body, last_bias=False),
            _discriminator((25, 25, 25), d_body, "fixed"))


def networks(hparams):
    return build_networks({**DEFAULTS, **hparams}, fixed_models, angle_models, small_angle_models)


def _weighted_layers(model):
    return [l for l in model.layers if isinstance(l, (layers.Dense, layers.Conv3D,
                                                      layers.BatchNormalization))]


def from_torch(torch_model, keras_model) -> None:
    """Copy a gan3d.py (PyTorch) generator or discriminator into its Keras twin, in place."""
    import torch

    mods = [m for m in torch_model.modules()
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv3d, torch.nn.BatchNorm3d))]
    if hasattr(torch_model, "dense"):  # generator: dense, body, last conv (module order)
        mods = [torch_model.dense] + [m for m in mods if m is not torch_model.dense]
    targets = _weighted_layers(keras_model)
    if len(mods) != len(targets):
        raise ValueError(f"{len(mods)} weighted torch layers vs {len(targets)} Keras layers")
    for m, layer in zip(mods, targets):
        t = {k: v.detach().cpu().numpy() for k, v in m.state_dict().items()}
        if isinstance(m, torch.nn.Linear):
            values = [t["weight"].T, t["bias"]]
        elif isinstance(m, torch.nn.Conv3d):
            values = [t["weight"].transpose(2, 3, 4, 1, 0)] + ([t["bias"]] if "bias" in t else [])
        else:
            values = [t["weight"], t["bias"], t["running_mean"], t["running_var"]]
        layer.set_weights([np.asarray(v) for v in values])  # assign casts to the layer's dtype


def trainable_count(model) -> int:
    return int(sum(np.prod(w.shape) for w in model.trainable_weights))


@keras.saving.register_keras_serializable(package="mpilearn")
class ReferenceRMSprop(keras.optimizers.RMSprop):
    """RMSprop as the reference (Keras 2) and torch compute it: eps outside the square root,
    w -= lr·g / (√v + eps). Keras 3 puts it inside (√(v + eps)), which for the reference's
    eps = 1e-7 changes every update whose gradients are small."""

    def update_step(self, gradient, variable, learning_rate):
        if self.momentum > 0 or self.centered:  # the reference uses neither
            return super().update_step(gradient, variable, learning_rate)
        lr = ops.cast(learning_rate, variable.dtype)
        gradient = ops.cast(gradient, variable.dtype)
        velocity = self._velocities[self._get_variable_index(variable)]
        self.assign(velocity, ops.add(ops.multiply(self.rho, velocity),
                                      ops.multiply(1 - self.rho, ops.square(gradient))))
        self.assign_sub(variable, ops.divide(ops.multiply(lr, gradient),
                                             ops.add(ops.sqrt(velocity), self.epsilon)))


def build(hparams):
    """The engine's entry point: a KerasGANTask (the reference RMSprop: lr 1e-3, rho 0.9,
    eps 1e-7 outside the square root)."""
    from mpilearn.calo.keras_gan import KerasGANTask

    hp = {**DEFAULTS, **hparams}
    generator, discriminator = networks(hp)

    def rmsprop():
        return ReferenceRMSprop(hp["lr"], rho=0.9, epsilon=1e-7)

    task = KerasGANTask(generator, discriminator, rmsprop(), rmsprop(), variant=hp["variant"],
                        loss_weights=hp["loss_weights"], label_flip=hp["label_flip"],
                        angle_key=hp["angle_key"], seed=hp["seed"])
    task.reduction = hp["reduction"]  # tape: four DistributedGradientTapes; fused: in apply()
    return task
