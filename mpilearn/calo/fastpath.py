"""The generator rewritten for CPU inference at small batches (``--precision fp32-fast`` /
``bf16-fast`` of generate and export): the same function to float rounding, with the work a
batch-1 call wasted removed.

- The first layer, a x6 nearest up-sampling then a 6x6x8 convolution, runs in the polyphase form
  (:mod:`.polyphase`): 0.21 GFLOP per shower instead of 3.63, of the full generator's 6.12.
- A zero ``ConstantPad3d`` before a convolution becomes the convolution's own padding (no padded
  copy per layer).
- fp32: every convolution goes to oneDNN. At batch 1 PyTorch sends fp32 convolutions with
  small inputs and kernels of 3 in the last two axes to its slow reference path
  (``slow_conv3d``): the generator's last two 3x3xK layers took 63 and 35 ms there, 6 and 4 ms
  in oneDNN. (bf16 convolutions always go to oneDNN.)
- bf16: weights cast once (autocast recasts them on every call) and activations in
  ``channels_last_3d``, the layout of oneDNN's bf16 kernels (NCDHW bf16 is 4x slower here).

``onednn=False`` keeps ``F.conv3d`` for exports: ONNX has no oneDNN operator and torch.export
cannot trace ``mkldnn_convolution``.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .polyphase import UpsampleConv3d, rewrite

PRECISIONS = {"fp32-fast": torch.float32, "bf16-fast": torch.bfloat16}
# showers per call of a fast generator: one shower's activations (4.5 MB fp32) stay in the CPU's
# caches; per shower, batch 16 was 1.5x slower than batch 1 in fp32-fast, batch 64 int8-fast 2x
CHUNK = 2


class PaddedConv3d(nn.Module):
    """``conv(pad(x))`` for a zero, symmetric ``pad``, as one convolution; through oneDNN on the
    CPU when ``onednn``."""

    def __init__(self, conv: nn.Conv3d, pad=(0,) * 6, onednn: bool = True):
        super().__init__()
        self.weight, self.bias, self.onednn = conv.weight, conv.bias, onednn
        # ConstantPad3d's tuple runs last axis first; the convolution's first axis first
        self.padding = [p + extra for p, extra in zip(conv.padding, pad[4::-2])]

    def forward(self, x):
        if self.onednn and x.device.type == "cpu":
            return torch.mkldnn_convolution(x, self.weight, self.bias, self.padding, [1, 1, 1],
                                            [1, 1, 1], 1)
        return F.conv3d(x, self.weight, self.bias, padding=self.padding)


def _foldable(pad, conv) -> bool:
    return isinstance(pad, nn.ConstantPad3d) and isinstance(conv, nn.Conv3d) and pad.value == 0 \
        and tuple(pad.padding[0::2]) == tuple(pad.padding[1::2]) and min(pad.padding) >= 0 \
        and not isinstance(conv.padding, str) and conv.stride == (1, 1, 1) \
        and conv.dilation == (1, 1, 1) and conv.groups == 1


def _plain_conv(conv) -> bool:
    return _foldable(nn.ConstantPad3d((0,) * 6, 0.0), conv)


def fold_padding(body: nn.Sequential, onednn: bool) -> nn.Sequential:
    """``body`` with each zero pad + convolution (and each lone convolution) as a PaddedConv3d."""
    mods, out, i = list(body), [], 0
    while i < len(mods):
        if i + 1 < len(mods) and _foldable(mods[i], mods[i + 1]):
            out.append(PaddedConv3d(mods[i + 1], mods[i].padding, onednn))
            i += 2
            continue
        if isinstance(mods[i], UpsampleConv3d):  # its phases' convolution
            mods[i].conv = PaddedConv3d(mods[i].conv, onednn=onednn)
        out.append(PaddedConv3d(mods[i], onednn=onednn) if _plain_conv(mods[i]) else mods[i])
        i += 1
    return nn.Sequential(*out)


class FastGenerator(nn.Module):
    """A copy of a ``gan3d.Generator`` rewritten as the module doc says, in ``dtype``; takes and
    returns what the generator does (the output in ``dtype``)."""

    def __init__(self, generator: nn.Module, dtype=torch.float32, onednn: bool = True):
        super().__init__()
        g = copy.deepcopy(generator).eval()
        self.seed_shape, self.channels, self.dtype = g.seed_shape, g.channels, dtype
        self.dense = g.dense
        onednn = onednn and dtype == torch.float32
        self.body = fold_padding(rewrite(g.body), onednn)
        self.last = PaddedConv3d(g.last, onednn=onednn) if _plain_conv(g.last) else g.last
        self.layout = torch.channels_last_3d if dtype == torch.bfloat16 else torch.contiguous_format
        self.to(dtype)
        for m in self.modules():  # oneDNN takes the weights in the activations' layout
            if isinstance(m, PaddedConv3d):
                m.weight.data = m.weight.data.contiguous(memory_format=self.layout)
        self.requires_grad_(False)

    def forward(self, z):
        x = self.dense(z.to(self.dtype)).view(-1, *self.seed_shape, self.channels)
        x = x.permute(0, 4, 1, 2, 3).contiguous(memory_format=self.layout)
        return torch.relu(self.last(self.body(x)))


def fast_shower_model(model, precision: str, onednn: bool = True):
    """``model`` (a ``runs.ShowerModel``) with its generator as a :class:`FastGenerator` in
    ``precision`` (a key of ``PRECISIONS``); the post-processing stays fp32."""
    from .runs import ShowerModel

    return ShowerModel(FastGenerator(model.generator, PRECISIONS[precision], onednn), model.variant)


class Chunked(nn.Module):
    """``model`` called on at most ``size`` showers at a time, whatever the batch (generate and
    bench/generate.py; an exported file takes its caller's batches)."""

    def __init__(self, model: nn.Module, size: int = CHUNK):
        super().__init__()
        self.model, self.size = model, size

    def forward(self, *inputs):
        n = inputs[0].shape[0]
        if n <= self.size:
            return self.model(*inputs)
        return torch.cat([self.model(*(None if x is None else x[i:i + self.size] for x in inputs))
                          for i in range(0, n, self.size)])
