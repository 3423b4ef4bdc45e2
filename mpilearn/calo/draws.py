"""Per-event keyed randomness, the same bits on the host (numpy) and on any torch device.

Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) is a
counter-based generator: block ``j`` of event ``i`` is a pure function of the counter
(j, i, step, purpose) and the key (the seed), so an event draws the same numbers whichever
rank holds it and however many events share its batch, and the whole batch's draws are a few
element-wise tensor operations on the device (no host draw, no copy). Every product is formed
from 16-bit halves so that it fits in int64 exactly: numpy int64 arrays and torch int64
tensors (CPU or CUDA) give identical bits, with no reliance on overflow behaviour.
"""
from __future__ import annotations

import math

import numpy as np

M32 = 0xFFFFFFFF
MUL = (0xD2511F53, 0xCD9E8D57)
BUMP = (0x9E3779B9, 0xBB67AE85)
ROUNDS = 10


def _mulhilo(a, m: int):
    """(high, low) 32-bit halves of the 64-bit product a * m (a: 32-bit values in int64)."""
    ah, al = a >> 16, a & 0xFFFF
    ph, pl = ah * m, al * m                       # each < 2**48
    hi = (ph + (pl >> 16)) >> 16
    lo = (pl + ((ph & 0xFFFF) << 16)) & M32
    return hi, lo


def philox(c0, c1, c2, c3, key: tuple):
    """Philox4x32-10 of the counters (int64 arrays or tensors of 32-bit values, broadcast
    together) under ``key`` (two ints < 2**32); returns the four 32-bit output words."""
    k0, k1 = key
    for r in range(ROUNDS):
        hi0, lo0 = _mulhilo(c0, MUL[0])
        hi1, lo1 = _mulhilo(c2, MUL[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + BUMP[0]) & M32, (k1 + BUMP[1]) & M32
    return c0, c1, c2, c3


def uniform_words(index, step: int, purpose: int, seed: int, count: int, xp, device=None):
    """(len(index), count) 32-bit words (int64) for the events ``index``: word w of event i
    is output word w % 4 of Philox block w // 4 at counter (block, i, step, purpose)."""
    for name, value, bits in (("step", step, 32), ("purpose", purpose, 32), ("seed", seed, 64)):
        if not 0 <= value < 1 << bits:
            raise ValueError(f"keyed draws: {name} must be in [0, 2**{bits}), got {value}")
    events = np.asarray(index, dtype=np.int64)
    if len(events) and (events.min() < 0 or events.max() > M32):  # checked on the host
        raise ValueError("keyed draws: event indices must be in [0, 2**32)")
    blocks = -(-count // 4)
    block = np.arange(blocks, dtype=np.int64)
    if xp is not np:
        events, block = (xp.as_tensor(a, device=device) for a in (events, block))
    out = philox(block[None, :], events[:, None], step, purpose, (seed & M32, (seed >> 32) & M32))
    words = xp.stack((np.broadcast_arrays if xp is np else xp.broadcast_tensors)(*out), -1)
    return words.reshape(len(events), blocks * 4)[:, :count]


def to_unit(words, xp):
    """32-bit words to float64 uniforms in (0, 1): (w + 1/2) / 2**32, exact."""
    w = words.astype(np.float64) if xp is np else words.to(xp.float64)
    return (w + 0.5) * (1.0 / 4294967296.0)


def box_muller(u, xp):
    """Standard normals from uniforms, pairwise along the last axis (even length)."""
    u1, u2 = u[..., 0::2], u[..., 1::2]
    r = xp.sqrt(-2.0 * xp.log(u1))
    angle = (2.0 * math.pi) * u2
    z = xp.stack([r * xp.cos(angle), r * xp.sin(angle)], -1)
    return z.reshape(u.shape)
