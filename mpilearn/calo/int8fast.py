"""``--precision int8-fast``: the fast generator (:mod:`.fastpath`) with its convolutions in int8
through oneDNN's int8 convolution (``torch.ops.onednn.qconv_pointwise``, the kernel PyTorch's
PT2E int8 path calls; AVX-512 VNNI), for CPUs; no deprecated quantised tensor types.

Each convolution takes its input quantised to uint8 with a scale and zero point calibrated
(min/max) on showers whose conditions are drawn from the run's training ranges
(``precision.conditions``), int8 weights with one scale per output channel, and gives fp32
out: ReLU, pixel shuffle and post-processing stay fp32; a batch norm right before a convolution
is folded into that convolution's quantisation step. ONNX Runtime's int8 forms of these 3-D
convolutions (ConvInteger, QDQ Conv, QLinearConv) were each slower than its fp32 Conv on this
CPU; oneDNN's were 3x faster than its fp32.
Calibration is seeded, so every rank builds the same model.
"""
from __future__ import annotations

import torch
from torch import nn

from .fastpath import FastGenerator, PaddedConv3d


class QuantizedConv3d(nn.Module):
    """``conv`` (a PaddedConv3d) as quantise to uint8 -> oneDNN int8 convolution with fp32
    output (+ ReLU)."""

    def __init__(self, conv: PaddedConv3d, lo: float, hi: float, relu: bool, shape):
        super().__init__()
        w = conv.weight.detach().float().contiguous()
        self.w_scale = (w.abs().amax(dim=(1, 2, 3, 4)) / 127).clamp_min(1e-12)
        qw = torch.round(w / self.w_scale[:, None, None, None, None]).clamp(-127, 127)
        lo, hi = min(lo, 0.0), max(hi, 1e-12)  # the range holds 0 (the padding's zeros)
        self.scale = (hi - lo) / 255
        self.zero_point = int(round(-lo / self.scale))
        self.padding, self.relu = list(conv.padding), relu
        self.bias = None if conv.bias is None else conv.bias.detach().float()
        self.w_zero = torch.zeros(len(self.w_scale), dtype=torch.long)
        self.packed = torch.ops.onednn.qconv_prepack(
            qw.to(torch.int8), self.w_scale, self.scale, self.zero_point, [1, 1, 1], self.padding,
            [1, 1, 1], 1, list(shape))
        # uint8 = x * mul + add, truncated (+0.5: rounded), clamped to [0, 255]
        self.mul = torch.tensor(1 / self.scale)
        self.add = torch.tensor(self.zero_point + 0.5)

    def absorb(self, bn: nn.BatchNorm3d) -> None:
        """Takes the batch norm before it into its quantisation (one pass fewer over the
        activations): quantise(bn(x)) with bn's per-channel scale and shift."""
        gain = bn.weight.detach().float() / torch.sqrt(bn.running_var.float() + bn.eps)
        shift = bn.bias.detach().float() - bn.running_mean.float() * gain
        self.mul = (gain / self.scale).reshape(1, -1, 1, 1, 1)
        self.add = (shift / self.scale + self.zero_point + 0.5).reshape(1, -1, 1, 1, 1)

    def forward(self, x):
        q = torch.addcmul(self.add, x.float(), self.mul).clamp_(0, 255)
        y = torch.ops.onednn.qconv_pointwise(
            q.to(torch.uint8), self.scale, self.zero_point, self.packed, self.w_scale, self.w_zero,
            self.bias, [1, 1, 1], self.padding, [1, 1, 1], 1, 1.0, 0, torch.float32, "none", [],
            "")  # oneDNN's conv3d takes no fused ReLU here
        return y.relu_() if self.relu else y


def _convs(gen: FastGenerator):
    """(module holding the conv, attribute, conv, a ReLU follows) for each convolution."""
    from .polyphase import UpsampleConv3d

    body = list(gen.body)
    out = []
    for i, m in enumerate(body):
        relu = i + 1 < len(body) and isinstance(body[i + 1], nn.ReLU)
        if isinstance(m, UpsampleConv3d):  # ReLU commutes with its pixel shuffle
            out.append((m, "conv", m.conv, relu))
        elif isinstance(m, PaddedConv3d):
            out.append((gen.body, str(i), m, relu))
    out.append((gen, "last", gen.last, True))  # the generator ends in a ReLU
    return out


def quantize(gen: FastGenerator, calibration) -> FastGenerator:
    """``gen`` (fp32) with its convolutions in int8, calibrated on the generator inputs ``z`` of
    ``calibration`` (an iterable of (n, latent) tensors)."""
    convs = _convs(gen)
    seen = {id(c): [float("inf"), -float("inf"), None] for _, _, c, _ in convs}

    def record(conv, inputs, output):
        r = seen[id(conv)]
        r[0], r[1] = min(r[0], float(inputs[0].min())), max(r[1], float(inputs[0].max()))
        r[2] = (1, *inputs[0].shape[1:])

    hooks = [c.register_forward_hook(record) for _, _, c, _ in convs]
    try:
        with torch.inference_mode():
            for z in calibration:
                gen(z)
    finally:
        for h in hooks:
            h.remove()
    for owner, name, conv, relu in convs:
        lo, hi, shape = seen[id(conv)]
        setattr(owner, name, QuantizedConv3d(conv, lo, hi, relu, shape))
        if relu and owner is gen.body:  # fused: the ReLU after it has nothing left to do
            gen.body[int(name) + 1] = nn.Identity()
    body = list(gen.body)
    for i in range(1, len(body)):  # a batch norm right before a convolution: into its quantisation
        if isinstance(body[i], QuantizedConv3d) and isinstance(body[i - 1], nn.BatchNorm3d):
            body[i].absorb(body[i - 1])
            gen.body[i - 1] = nn.Identity()
    return gen


def int8_shower_model(model, meta: dict, batches: int = 8, batch: int = 4, seed: int = 1234):
    """``model`` (a ``runs.ShowerModel``) as the int8 fast generator, calibrated on ``batches``
    x ``batch`` showers of conditions from the training ranges in ``meta`` (export metadata, or
    {"variant": ..., "energy_range_gev": ..., "angle_range_deg": ...})."""
    from . import precision
    from .runs import ShowerModel

    latent = model.generator.dense.in_features - (2 if model.variant == "angle" else 0)
    gen = FastGenerator(model.generator, torch.float32)

    def z_of(i):
        feeds = {k: torch.from_numpy(v) for k, v in
                 precision.conditions(meta, batch, seed + i, latent).items()}
        if model.variant == "angle":
            return torch.cat([feeds["energy"][:, None], feeds["angle"][:, None], feeds["noise"]], 1)
        return feeds["energy"][:, None] * feeds["noise"]

    return ShowerModel(quantize(gen, (z_of(i) for i in range(batches))), model.variant)
