"""Gradient compression with Horovod's interface: ``compress(tensor) -> (tensor, ctx)`` and
``decompress(tensor, ctx)``. The fused gradient path applies it to whole buckets, which is
the same thing for element-wise compressors such as these."""
from __future__ import annotations

import torch


class Compressor:
    """Interface for compressing and decompressing a tensor."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _CastCompressor(Compressor):
    dtype = None

    @classmethod
    def compress(cls, tensor):
        if tensor.dtype.is_floating_point:
            return tensor.type(cls.dtype), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.type(ctx) if ctx is not None and ctx.is_floating_point else tensor


class FP16Compressor(_CastCompressor):
    """Floating-point tensors travel as float16."""
    dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Floating-point tensors travel as bfloat16."""
    dtype = torch.bfloat16


class Compression:
    """The compressors, under Horovod's names."""
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
