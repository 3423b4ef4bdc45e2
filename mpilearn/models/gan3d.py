"""3DGAN in PyTorch, built layer for layer like the Keras reference (reference 3dgan.md §1).

Variants (``hparams.variant``):
  angle  51x51x25, conditioned on [E/100, θ, 254 x N(0,1)]; D has 4 outputs
         (real/fake, E/100, measured angle, cell sum). G 1 364 983 / D 87 354 trainable.
  fixed  25x25x25, conditioned multiplicatively (E/100 · z, z in R^200); D has 3 outputs
         (real/fake, E/100, cell sum). G 872 808 / D 73 402 trainable.
``hparams.preset: small`` keeps the angle model's inputs, outputs, heads and losses but with
few, narrow layers, for CPU tests and demos. ``preset: smooth`` (issue 49 part 3) does the same
with a generator that grows the shower by x2 trilinear steps, each followed by a convolution,
instead of the small preset's x6 nearest-neighbour copy, whose 6-cell blocks show in every
profile; its widths are hyperparameters (``g_channels``, ``d_channels``) for a sweep.

Faithful-port checklist (§1c): LeakyReLU 0.3, nearest up-sampling, BN momentum 0.01 (Keras
0.99) and eps 1e-6, Keras "same" padding for even kernels (2 before / 3 after for 6), explicit
Keras initialisers, channels-last flatten order, sigmoid + clipped BCE, MAPE divides by the
label, RMSprop(lr 1e-3, alpha 0.9, eps 1e-7).
"""
import math

import torch
from torch import nn

from mpilearn.calo.format import measured_angle
from mpilearn.calo.gan import GANTask, build_networks

DEFAULTS = {
    "variant": "angle",        # angle | fixed
    "preset": "full",          # full | small | smooth
    "lr": 1e-3,                # RMSprop, both models
    "loss_weights": None,      # default [3, 0.1, 25, 0.1] (angle) / [2, 0.1, 0.1] (fixed)
    "label_flip": 0.05,
    "dropout": 0.2,
    "batch_norm": True,
    "angle_key": "mtheta",     # conditioning angle: mtheta (measured) or theta
    "seed": 0,                 # noise and label-flip streams
    "dtype": "float32",        # float64 for exact equivalence tests
    "g_channels": [4, 15, 7],  # smooth preset: G's seed, first and second convolution widths
                               # (the sweep's best, jobs/hpo-3dgan-smooth.yaml; it also chose lr 2.4e-3)
    "d_channels": 8,           # smooth preset: D's convolution widths
}
HPARAMS = {"variant": ["angle", "fixed"], "preset": ["full", "small", "smooth"], "lr": "[0, inf)",
           "label_flip": "[0, 1]", "dropout": "[0, 1)", "batch_norm": [True, False],
           "angle_key": ["mtheta", "theta"], "seed": "int [0, inf)",
           "dtype": ["float32", "float64"], "d_channels": "int [1, inf)"}
POWER = 0.85


def _same(kernel):
    """Keras 'same' padding for stride 1, as ConstantPad3d arguments (z, y, x order)."""
    pads = []
    for k in reversed(kernel):
        before = (k - 1) // 2
        pads += [before, k - 1 - before]
    return nn.ConstantPad3d(tuple(pads), 0.0)


def _pad(x, y, z):
    return nn.ConstantPad3d((z, z, y, y, x, x), 0.0)


def _bn(ch):
    return nn.BatchNorm3d(ch, eps=1e-6, momentum=0.01)


def _act(kind):
    return nn.ReLU() if kind == "relu" else nn.LeakyReLU(0.3)


def _conv_block(cin, cout, kernel, pad, act, bn, dropout=0.0):
    layers = [pad] if pad is not None else []
    layers += [nn.Conv3d(cin, cout, kernel), _act(act)]
    if bn:
        layers.append(_bn(cout))
    if dropout:
        layers.append(nn.Dropout(dropout))
    return layers


def _keras_init(module, conv_init):
    """Keras initialisers: Dense glorot_uniform, convs ``conv_init``, zero biases."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Conv3d):
            if conv_init == "he_uniform":
                nn.init.kaiming_uniform_(m.weight, nonlinearity="relu")
            else:
                nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def _glorot_normal(conv):
    """Keras glorot_normal: normal truncated at 2 std, std = sqrt(2/(fan_in+fan_out))/.8796."""
    receptive = conv.weight[0, 0].numel()
    fan_in, fan_out = conv.in_channels * receptive, conv.out_channels * receptive
    std = math.sqrt(2.0 / (fan_in + fan_out)) / 0.87962566103423978
    nn.init.trunc_normal_(conv.weight, std=std, a=-2 * std, b=2 * std)


class Generator(nn.Module):
    def __init__(self, latent, seed_shape, channels, body, last_bias=True, last_kernel=2):
        super().__init__()
        self.seed_shape, self.channels = seed_shape, channels
        self.dense = nn.Linear(latent, int(math.prod(seed_shape)) * channels)
        self.body = nn.Sequential(*body)
        cin = [m for m in body if isinstance(m, nn.Conv3d)][-1].out_channels
        self.last = nn.Conv3d(cin, 1, last_kernel, bias=last_bias)
        _keras_init(self, "he_uniform")
        _glorot_normal(self.last)

    def forward(self, z):
        x = self.dense(z).view(-1, *self.seed_shape, self.channels)  # Keras reshape; -1 keeps an exported batch dynamic
        x = x.permute(0, 4, 1, 2, 3)
        return torch.relu(self.last(self.body(x)))


class Discriminator(nn.Module):
    """Conv features -> (P(real), E/100 regression, [measured angle], cell sum)."""

    def __init__(self, body, flat, variant):
        super().__init__()
        self.body, self.variant = nn.Sequential(*body), variant
        self.real = nn.Linear(flat, 1)
        self.aux = nn.Linear(flat, 1)
        _keras_init(self, "glorot_uniform")

    def forward(self, x):
        h = self.body(x)
        h = h.permute(0, 2, 3, 4, 1).flatten(1)  # Keras flattens channels-last
        p = torch.sigmoid(self.real(h)).squeeze(1)
        aux = self.aux(h).squeeze(1)
        if self.variant == "fixed":
            return p, aux, x.sum(dim=(1, 2, 3, 4))
        raw = x.clamp_min(0).squeeze(1) ** (1.0 / POWER)  # fixed Lambdas: undo the power
        return p, aux, measured_angle(raw), raw.sum(dim=(1, 2, 3))


def angle_models(bn=True, dropout=0.2):
    g_body = [nn.Upsample(scale_factor=6, mode="nearest"),
              *_conv_block(8, 8, (6, 6, 8), None, "relu", bn),
              *_conv_block(8, 6, (4, 4, 6), _pad(2, 2, 1), "relu", bn),
              *_conv_block(6, 6, (4, 4, 6), _pad(2, 2, 1), "relu", bn),
              *_conv_block(6, 6, (4, 4, 6), _pad(2, 2, 1), "relu", bn),
              *_conv_block(6, 6, (3, 3, 5), _pad(1, 1, 0), "relu", bn),
              *_conv_block(6, 6, (3, 3, 3), _pad(1, 1, 0), "relu", False)]
    g = Generator(256, (9, 9, 8), 8, g_body, last_bias=True)
    d_body = [*_conv_block(1, 16, (5, 6, 6), _same((5, 6, 6)), "leaky", False, dropout),
              *_conv_block(16, 8, (5, 6, 6), _pad(0, 0, 1), "leaky", bn, dropout),
              *_conv_block(8, 8, (5, 6, 6), _pad(0, 0, 1), "leaky", bn, dropout),
              *_conv_block(8, 8, (5, 6, 6), None, "leaky", bn, dropout),
              nn.AvgPool3d(2)]
    return g, Discriminator(d_body, 19 * 18 * 7 * 8, "angle")


def small_angle_models(bn=True, dropout=0.2):
    """Same inputs, outputs and heads as the angle model; a few narrow layers for CPUs."""
    g_body = [nn.Upsample(scale_factor=(6, 6, 5), mode="nearest"),          # 54x54x25
              *_conv_block(2, 2, (4, 4, 3), _pad(0, 0, 1), "relu", bn)]     # 51x51x25
    g = Generator(256, (9, 9, 5), 2, g_body, last_bias=True, last_kernel=1)
    return g, small_discriminator(bn, dropout)


def small_discriminator(bn=True, dropout=0.2, channels=8):
    d_body = [nn.AvgPool3d(2),                                                # 25x25x12
              *_conv_block(1, channels, (3, 3, 3), _same((3, 3, 3)), "leaky", False, dropout),
              nn.AvgPool3d(2),                                                # 12x12x6
              *_conv_block(channels, channels, (3, 3, 3), None, "leaky", bn, dropout)]  # 10x10x4
    return Discriminator(d_body, 10 * 10 * 4 * channels, "angle")


def smooth_angle_models(bn=True, dropout=0.2, g_channels=(4, 15, 7), d_channels=8):
    """The small preset's inputs, outputs, heads, losses and discriminator (``d_channels``
    wide); a generator with no nearest-neighbour copy: two x2 trilinear up-samplings, each
    smoothed by a 3x3x3 convolution, then one valid convolution to the 51x51x25 grid
    (``g_channels``: the seed's, the first and the second convolution's widths)."""
    seed, first, second = (int(c) for c in g_channels)
    g_body = [nn.Upsample(scale_factor=2, mode="trilinear", align_corners=False),  # 26x26x14
              *_conv_block(seed, first, (3, 3, 3), _same((3, 3, 3)), "relu", bn),
              nn.Upsample(scale_factor=2, mode="trilinear", align_corners=False),  # 52x52x28
              *_conv_block(first, second, (3, 3, 3), _same((3, 3, 3)), "relu", bn),
              *_conv_block(second, second, (2, 2, 4), None, "relu", bn)]        # 51x51x25
    g = Generator(256, (13, 13, 7), seed, g_body, last_bias=True, last_kernel=1)
    return g, small_discriminator(bn, dropout, int(d_channels))


def fixed_models(bn=True, dropout=0.2):
    g_body = [*_conv_block(8, 64, (6, 6, 8), _same((6, 6, 8)), "leaky", bn),
              nn.Upsample(scale_factor=2, mode="nearest"),
              *_conv_block(64, 6, (6, 5, 8), _pad(2, 2, 0), "leaky", bn),
              nn.Upsample(scale_factor=(2, 2, 3), mode="nearest"),
              *_conv_block(6, 6, (3, 3, 8), _pad(1, 0, 3), "leaky", False)]
    g = Generator(200, (7, 7, 8), 8, g_body, last_bias=False)
    d_body = [*_conv_block(1, 32, (5, 5, 5), _same((5, 5, 5)), "leaky", False, dropout),
              *_conv_block(32, 8, (5, 5, 5), _pad(2, 2, 2), "leaky", bn, dropout),
              *_conv_block(8, 8, (5, 5, 5), _pad(2, 2, 2), "leaky", bn, dropout),
              *_conv_block(8, 8, (5, 5, 5), _pad(1, 1, 1), "leaky", bn, dropout),
              nn.AvgPool3d(2)]
    return g, Discriminator(d_body, 11 * 11 * 11 * 8, "fixed")


def networks(hparams):
    hp = {**DEFAULTS, **hparams}

    def smooth(bn, dropout):
        if len(hp["g_channels"]) != 3 or min(int(c) for c in hp["g_channels"]) < 1:
            raise ValueError(f"hparams.g_channels must be 3 positive widths, got {hp['g_channels']}")
        return smooth_angle_models(bn, dropout, hp["g_channels"], hp["d_channels"])

    return build_networks(hp, fixed_models, angle_models, small_angle_models, smooth)


def build(hparams):
    hp = {**DEFAULTS, **hparams}
    generator, discriminator = networks(hp)

    def rmsprop(model):
        return torch.optim.RMSprop(model.parameters(), lr=hp["lr"], alpha=0.9, eps=1e-7)

    return GANTask(generator, discriminator, rmsprop(generator), rmsprop(discriminator),
                   variant=hp["variant"], loss_weights=hp["loss_weights"],
                   label_flip=hp["label_flip"], angle_key=hp["angle_key"], seed=hp["seed"],
                   dtype=getattr(torch, hp["dtype"]))
