"""Which initial 3DGAN generators make empty showers in inference mode (issue 37's PyTorch rows).

    python bench/gan_init.py [--seeds 16] [--framework torch|keras] [--out bench/results/gan_init]

Per train.seed: the full angle generator, built as ``mpilearn.train`` builds it (the framework
seeded with train.seed first), makes 32 showers (E = 150 GeV, θ = 90°) in inference mode (batch
norm on its running statistics, as ``mpilearn.generate`` and the reference's ``predict``) and in
training mode (batch statistics). A shower is empty when its cell sum (GeV x 50) is <= 10, the
preprocessing's cut. Until the running statistics warm up (momentum 0.01: a few hundred
steps), inference mode does not normalise the post-ReLU activations (at seed 0 their mean grows
from 0.2 to 1.8 through the body), and the last convolution can put every cell below zero,
which the output ReLU makes an empty shower.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "models"))
EVENTS, CUT = 32, 10.0


def latent(seed=0):
    noise = np.random.default_rng(seed).normal(size=(EVENTS, 254))
    return np.concatenate([np.full((EVENTS, 1), 1.5), np.full((EVENTS, 1), np.pi / 2), noise],
                          axis=1).astype("float32")


def shower_sums(powered):
    """Each shower's cell sum (GeV x 50), from the generator's output x^0.85."""
    cells = np.maximum(np.asarray(powered, np.float64), 0) ** (1 / 0.85)
    return cells.reshape(len(cells), -1).sum(1)


def torch_generator(seed):
    import torch
    import gan3d

    torch.manual_seed(seed)
    g, _ = gan3d.networks({"preset": "full"})

    def run(training):
        g.train(training)
        with torch.no_grad():
            return g(torch.from_numpy(latent())).numpy()
    return run


def keras_generator(seed):
    import keras
    import gan3d_keras

    from mpilearn.train.setup import seed_keras

    seed_keras(seed)
    g, _ = gan3d_keras.networks({"preset": "full"})
    return lambda training: keras.ops.convert_to_numpy(g(latent(), training=training))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=16)
    p.add_argument("--framework", choices=("torch", "keras"), default="torch")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    a.out = a.out or os.path.join(REPO, "bench", "results", f"gan_init_{a.framework}")
    make = torch_generator if a.framework == "torch" else keras_generator
    rows = []
    for seed in range(a.seeds):
        run = make(seed)
        inference, training = shower_sums(run(False)), shower_sums(run(True))
        rows.append({"seed": seed, "empty_inference": float(np.mean(inference <= CUT)),
                     "empty_training": float(np.mean(training <= CUT)),
                     "median_sum_inference": float(np.median(inference))})
        print(rows[-1], flush=True)
    dead = [r["seed"] for r in rows if r["empty_inference"] > 0.5]
    lines = [f"{a.framework} full angle generator, untrained, {EVENTS} showers at 150 GeV and 90 deg "
             f"per train.seed; empty: cell sum <= {CUT} (GeV x 50).", "",
             "| train.seed | empty, inference mode | empty, training mode | median shower sum, "
             "inference (GeV x 50) |", "|---|---|---|---|"]
    lines += [f"| {r['seed']} | {r['empty_inference']:.0%} | {r['empty_training']:.0%} | "
              f"{r['median_sum_inference']:.4g} |" for r in rows]
    sums = [r["median_sum_inference"] for r in rows]
    lines += ["", f"Median shower sum over the seeds: {np.median(sums):.4g} (range {min(sums):.4g}-"
              f"{max(sums):.4g}); a 150 GeV MC shower sums to about 147.",
              "", f"Seeds whose showers are mostly empty in inference mode: {dead or 'none'} "
              f"({len(dead)} of {len(rows)}). Command: `python bench/gan_init.py "
              f"--seeds {a.seeds} --framework {a.framework}`."]
    write(a.out, {"framework": a.framework, "events": EVENTS, "rows": rows, "dead_seeds": dead}, lines)


if __name__ == "__main__":
    main()
