"""The generator rewritten for CPU inference (mpilearn.calo.polyphase, mpilearn.calo.fastpath):
the same function as the layers it replaces."""
import pytest
import torch
import torch.nn.functional as F

from mpilearn.calo.export import example_inputs
from mpilearn.calo.fastpath import Chunked, FastGenerator, fast_shower_model
from mpilearn.calo.polyphase import UpsampleConv3d
from mpilearn.calo.runs import ShowerModel
from mpilearn.models import gan3d


@pytest.mark.parametrize("scale, kernel, size, pad", [
    ((6, 6, 6), (6, 6, 8), (9, 9, 8), (0,) * 6),         # the full generator's first layer
    ((6, 6, 5), (4, 4, 3), (9, 9, 5), (1, 1, 0, 0, 0, 0)),  # the small preset's, padded
    ((3, 2, 4), (4, 3, 5), (4, 5, 3), (2, 7, 1, 0, 3, 1)),  # uneven pads, kernels, scales
    ((1, 1, 2), (1, 1, 3), (1, 1, 4), (0,) * 6)])
def test_polyphase_equals_upsampling_padding_then_convolution(scale, kernel, size, pad):
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(3, 4, kernel).double()
    x = torch.randn(2, 3, *size, dtype=torch.float64)
    expected = conv(F.pad(F.interpolate(x, scale_factor=scale, mode="nearest"), pad))
    got = UpsampleConv3d(scale, conv, pad)(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def _generator(preset):
    torch.manual_seed(1)
    g = gan3d.networks({"preset": preset})[0]
    for m in g.modules():  # batch norm that does something
        if isinstance(m, torch.nn.BatchNorm3d):
            m.running_mean.uniform_(0, 0.1)
            m.running_var.uniform_(0.5, 2)
    return ShowerModel(g, "angle")


@pytest.mark.parametrize("preset", ["small", "full"])
def test_fast_generator_is_the_same_function(preset):
    model = _generator(preset)
    fast = fast_shower_model(model, "fp32-fast")
    layers = [type(m).__name__ for m in fast.generator.body]
    assert layers[0] == "UpsampleConv3d" and "ConstantPad3d" not in layers, layers
    for n in (1, 3):
        inputs = example_inputs(model, n, seed=n)
        with torch.inference_mode():
            expected, got = model(*inputs), fast(*inputs)
            chunked = Chunked(fast, 2)(*inputs)  # what generate runs: calls of 2 showers
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())
        torch.testing.assert_close(chunked, got, rtol=1e-4, atol=1e-5 * expected.abs().max().item())
    bf16 = fast_shower_model(model, "bf16-fast")
    assert next(bf16.generator.parameters()).dtype == torch.bfloat16
    with torch.inference_mode():  # bf16 (not fp32), near the fp32 showers; the physics gate of
        got = bf16(*inputs)       # export --precision bf16-fast judges how near
    assert got.dtype == torch.float32 and 0 < (got - expected).abs().max() < 0.25 * expected.abs().max()
    # the original generator is untouched (the rewrite works on a copy)
    assert [type(m).__name__ for m in model.generator.body][0] == "Upsample"
    assert isinstance(FastGenerator(model.generator).dense, torch.nn.Linear)
