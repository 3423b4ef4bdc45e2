"""The PyTorch 3DGAN and its Keras twin trained from the same initial weights (issue 37).

    python bench/gan_twins.py [--seed 2] [--steps 3] [--batch 64] [--preset full]
                              [--dtype float32] [--out bench/results/gan_twins_seed2]

The PyTorch generator and discriminator are built as ``mpilearn.train`` builds them
(``torch.manual_seed(seed)``), copied into the Keras twin (Keras 3 on its torch backend), and
each task takes the same steps on the same simulated showers (100-200 GeV, angle geometry;
dropout off, as the frameworks draw different masks). After every step both generators make
32 showers at 150 GeV and 90 deg in inference mode (what ``mpilearn.generate`` does); the table
gives each one's median cell sum (GeV x 50; a 150 GeV MC shower sums to about 146), its share
of empty showers (sum <= 10) and the losses. ``tests/test_keras.py`` checks the first step's
equality in float64 on the small model; this shows where a full-size float32 run goes.
"""
import argparse
import os
import sys
import tempfile
import time

os.environ["KERAS_BACKEND"] = "torch"
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write  # noqa: E402
from gan_init import latent, shower_sums  # noqa: E402 (the same 32 showers as gan_init.py)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "models"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--preset", choices=("full", "small"), default="full")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    a.out = a.out or os.path.join(REPO, "bench", "results", f"gan_twins_seed{a.seed}")

    import h5py
    import keras
    import torch
    from mpi4py import MPI

    import gan3d
    import gan3d_keras
    import mpilearn.torch as hvd
    from mpilearn.calo.simulate import simulate

    keras.config.set_floatx(a.dtype)
    hvd.init()
    hparams = {"preset": a.preset, "dropout": 0.0}
    torch.manual_seed(a.seed)
    twins = {"torch": gan3d.build({**hparams, "dtype": a.dtype}), "keras": gan3d_keras.build(hparams)}
    for name in ("generator", "discriminator"):
        gan3d_keras.from_torch(twins["torch"].models()[name], twins["keras"].models()[name])
    for task in twins.values():
        task.setup(MPI.COMM_SELF, "cpu", "mpi", 0)
    with tempfile.TemporaryDirectory() as folder:
        path, = simulate(folder, a.batch * a.steps, seed=1, progress=False)
        with h5py.File(path) as f:
            data = {k: f[k][:] for k in ("ECAL", "energy", "mtheta")}
    z = latent().astype(a.dtype)

    def showers():
        g = twins["torch"].generator.eval()
        with torch.no_grad():
            out = {"torch": g(torch.from_numpy(z)).numpy()[:, 0]}
        out["keras"] = keras.ops.convert_to_numpy(twins["keras"].generator(z, training=False))[..., 0]
        row = {}
        for name, x in out.items():
            sums = shower_sums(x)
            row[name] = {"median_sum": float(np.median(sums)), "empty": float(np.mean(sums <= 10))}
        row["max_output_difference"] = float(np.max(np.abs(out["torch"] - out["keras"])))
        return row

    rows = [{"step": 0, **showers()}]
    for step in range(a.steps):
        part = slice(step * a.batch, (step + 1) * a.batch)
        batch = {k: v[part] for k, v in data.items()}
        batch["_index"] = np.arange(part.start, part.stop)
        t0 = time.time()
        losses = {name: task.train_step(task.transform(dict(batch))) for name, task in twins.items()}
        rows.append({"step": step + 1, "seconds": time.time() - t0, "losses": losses, **showers()})
        print(rows[-1], flush=True)
    lines = [f"PyTorch 3DGAN and Keras twin (torch backend) from PyTorch's train.seed {a.seed} weights, "
             f"preset {a.preset}, {a.dtype}, batch {a.batch}, dropout off; 32 showers at 150 GeV, "
             "90 deg, inference mode, after each step.", "",
             "| step | median shower sum, PyTorch | median, Keras | empty, PyTorch | empty, Keras "
             "| g_loss PyTorch / Keras | d_loss PyTorch / Keras |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        loss = r.get("losses")
        pair = (lambda k: f"{loss['torch'][k]:.5g} / {loss['keras'][k]:.5g}") if loss else (lambda k: "")
        lines.append(f"| {r['step']} | {r['torch']['median_sum']:.4g} | {r['keras']['median_sum']:.4g} | "
                     f"{r['torch']['empty']:.0%} | {r['keras']['empty']:.0%} | {pair('g_loss')} | "
                     f"{pair('d_loss')} |")
    lines += ["", f"Command: `python bench/gan_twins.py --seed {a.seed} --steps {a.steps} --batch "
              f"{a.batch} --preset {a.preset} --dtype {a.dtype}`."]
    write(a.out, {"args": vars(a), "rows": rows}, lines)


if __name__ == "__main__":
    main()
