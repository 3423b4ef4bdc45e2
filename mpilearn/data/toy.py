"""A small synthetic regression dataset (HDF5 keys ``X`` and ``y``) for examples and tests."""
from __future__ import annotations

import os

import numpy as np

from ..core.io import atomic_write_bytes


def write_regression(path: str, events: int = 4096, features: int = 8, seed: int = 0) -> str:
    """y = sin(X.a) + 0.5 X.b + noise, with fixed a, b: learnable, not linear."""
    import h5py

    rng = np.random.default_rng(seed)
    w = np.random.default_rng(12345).normal(size=(2, features)) / np.sqrt(features)
    X = rng.normal(size=(events, features)).astype(np.float32)
    y = (np.sin(X @ w[0] * 2) + 0.5 * (X @ w[1]) + 0.05 * rng.normal(size=events))
    y = y.astype(np.float32)[:, None]

    def write(f):
        with h5py.File(f, "w") as h:
            h.create_dataset("X", data=X)
            h.create_dataset("y", data=y)

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_bytes(path, write)
    return path


def main(argv=None) -> int:
    """python -m mpilearn.data.toy OUTPUT.h5 [--events N]: the README's example data."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m mpilearn.data.toy", description=main.__doc__)
    p.add_argument("output")
    p.add_argument("--events", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(write_regression(args.output, args.events, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
