"""Nearest up-sampling followed by a valid convolution, rewritten as one small convolution on
the un-sampled input plus a pixel shuffle (the polyphase form), for inference.

Up-sampling by S copies every input cell S times along each axis, so an output cell of the
convolution at ``o = S*q + r`` sees at most ``T = (S + K - 2) // S + 1`` distinct input cells
along an axis of kernel K: ``out[S*q + r] = sum_t W_r[t] * x[q + t]``, where ``W_r[t]`` sums the
kernel taps k with ``(r + k) // S == t``. All S**3 phases together are one convolution with
``C_out * S**3`` output channels and a T-tap kernel over the small input, then a reshape and a
permute interleave the phases. The result is the same function (to float rounding); for the full
angle generator's first layer (x6, kernel 6x6x8) it does 0.21 GFLOP instead of 3.63.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F


def _phase_matrix(scale: int, kernel: int) -> torch.Tensor:
    """(scale, taps, kernel) 0/1: phase r's tap t sums kernel positions k with (r+k)//scale == t."""
    taps = (scale + kernel - 2) // scale + 1
    m = torch.zeros(scale, taps, kernel, dtype=torch.float64)
    for r in range(scale):
        for k in range(kernel):
            m[r, (r + k) // scale, k] = 1.0
    return m


class UpsampleConv3d(nn.Module):
    """``conv(pad(Upsample(scale, nearest)(x)))`` for a Conv3d ``conv`` without padding,
    stride or dilation and ``pad`` zeros (``ConstantPad3d``'s 6-tuple, last axis first),
    computed in the polyphase form (module doc)."""

    def __init__(self, scale, conv: nn.Conv3d, pad=(0,) * 6):
        super().__init__()
        if conv.stride != (1, 1, 1) or conv.dilation != (1, 1, 1) or conv.groups != 1 or \
                any(p != 0 for p in conv.padding) or isinstance(conv.padding, str):
            raise ValueError("UpsampleConv3d needs a plain valid convolution")
        self.scale = tuple(scale) if isinstance(scale, (tuple, list)) else (scale,) * 3
        self.kernel = conv.kernel_size
        self.cout = conv.out_channels
        # zeros padded after up-sampling = whole zero cells padded before it, then a crop
        before, after = pad[4::-2], pad[5::-2]  # (x, y, z)
        self.cells = tuple((-(-b // s), -(-a // s)) for b, a, s in zip(before, after, self.scale))
        self.start = tuple(c * s - b for (c, _), b, s in zip(self.cells, before, self.scale))
        self.extra = tuple(b + a for b, a in zip(before, after))
        sx, sy, sz = self.scale
        mx, my, mz = (_phase_matrix(s, k) for s, k in zip(self.scale, self.kernel))
        # weight[o, i, rx, ry, rz, tx, ty, tz] = sum_k w[o, i, kx, ky, kz] over each phase's taps
        w = torch.einsum("oiabc,xpa,yqb,zrc->oxyzipqr", conv.weight.detach().double(), mx, my, mz)
        self.taps = tuple(w.shape[-3:])
        # one convolution for all phases: output channel (o, rx, ry, rz)
        self.conv = nn.Conv3d(conv.in_channels, self.cout * sx * sy * sz, self.taps)
        self.conv.weight.data = w.reshape(self.conv.weight.shape).to(conv.weight.dtype)
        bias = conv.bias.detach() if conv.bias is not None else torch.zeros(self.cout)
        self.conv.bias.data = bias.repeat_interleave(sx * sy * sz).to(conv.weight.dtype)
        self.conv.requires_grad_(False)

    def forward(self, x):
        # zero cells for the padding, and after the end taps - 1 more: the taps that read past
        # the end have zero weight for every kept output
        (bx, ax), (by, ay), (bz, az) = self.cells
        tx, ty, tz = self.taps
        x = F.pad(x, (bz, az + tz - 1, by, ay + ty - 1, bx, ax + tx - 1))
        dx, dy, dz = x.shape[2] - tx + 1, x.shape[3] - ty + 1, x.shape[4] - tz + 1
        y = self.conv(x)  # (n, C*S^3, dx, dy, dz)
        sx, sy, sz = self.scale
        y = y.reshape(-1, self.cout, sx, sy, sz, dx, dy, dz).permute(0, 1, 5, 2, 6, 3, 7, 4)
        y = y.reshape(-1, self.cout, dx * sx, dy * sy, dz * sz)
        cx, cy, cz = self.start
        lx, ly, lz = ((d - bc - ac) * s + e - k + 1 for d, (bc, ac), s, e, k in
                      zip((dx, dy, dz), self.cells, self.scale, self.extra, self.kernel))
        return y[:, :, cx:cx + lx, cy:cy + ly, cz:cz + lz]


def rewrite(body: nn.Sequential) -> nn.Sequential:
    """``body`` with every nearest Upsample followed by a valid Conv3d (a zero ConstantPad3d
    between them allowed) replaced by an :class:`UpsampleConv3d`; the other layers shared, not
    copied. Returns ``body`` itself when there is nothing to rewrite."""
    layers, i, mods = [], 0, list(body) + [None, None]  # None: past the end
    while mods[i] is not None:
        m = mods[i]
        pad = mods[i + 1] if _zero_pad(mods[i + 1]) else None
        conv = mods[i + 2] if pad is not None else mods[i + 1]
        nearest = isinstance(m, nn.Upsample) and m.mode == "nearest"
        scale = _integer_scale(m.scale_factor) if nearest else None
        if scale and _plain(conv):
            layers.append(UpsampleConv3d(scale, conv, pad.padding if pad is not None else (0,) * 6))
            i += 3 if pad is not None else 2
        else:
            layers.append(m)
            i += 1
    return nn.Sequential(*layers) if len(layers) < len(body) else body


def _zero_pad(m) -> bool:
    return isinstance(m, nn.ConstantPad3d) and m.value == 0 and min(m.padding) >= 0


def _plain(conv) -> bool:
    return isinstance(conv, nn.Conv3d) and not isinstance(conv.padding, str) and \
        tuple(conv.padding) == (0, 0, 0) and conv.stride == (1, 1, 1) and \
        conv.dilation == (1, 1, 1) and conv.groups == 1


def _integer_scale(factor):
    factors = factor if isinstance(factor, (tuple, list)) else (factor,) * 3
    if factors is None or len(factors) != 3 or any(float(f) != int(f) or f < 1 for f in factors):
        return None
    return tuple(int(f) for f in factors)
