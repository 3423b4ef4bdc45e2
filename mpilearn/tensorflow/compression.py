"""Horovod's ``Compression`` for ``tf.Tensor``s: ``compress(tensor) -> (tensor, ctx)``."""
from __future__ import annotations

import tensorflow as tf

from ..torch.compression import Compressor, NoneCompressor  # framework-neutral


class _CastCompressor(Compressor):
    dtype = None

    @classmethod
    def compress(cls, tensor):
        tensor = tf.convert_to_tensor(tensor)
        if tensor.dtype.is_floating:
            return tf.cast(tensor, cls.dtype), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tf.cast(tensor, ctx) if ctx is not None and ctx.is_floating else tensor


class FP16Compressor(_CastCompressor):
    """Floating-point tensors travel as float16."""
    dtype = tf.float16


class BF16Compressor(_CastCompressor):
    """Floating-point tensors travel as bfloat16."""
    dtype = tf.bfloat16


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
