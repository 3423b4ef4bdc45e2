"""The full angle 3DGAN on this CPU: events/s in fp32 and bf16, the fraction of the FLOP floor
each reaches, and whether the bf16 loss curve tracks fp32's.

    python bench/gan_cpu.py [--quick] [--rows fp32:off,bf16:off,fp32:default] [--preset full]
                            [--no-curves] [--out bench/results/gan_cpu]

1. Throughput: ``mpilearn.train`` (through bench/throughput.py's runner), 1 rank, 2 threads,
   batch 8, full angle model, the second epoch (the first holds torch.compile's compilation);
   one row per train.precision:train.compile pair of ``--rows``.
2. FLOPs per event per step: torch.utils.flop_counter around one training step (the four
   updates, forward and backward convolutions and matmuls), divided by the batch.
3. Loss tracking: 200 steps of the same batches from the same initial weights in fp32 and in
   bf16 (autocast, fp32 master weights). 200 steps of the full model take about an hour per
   precision here, so this part runs the small preset (same protocol, same losses): the
   20-step windowed means of d_loss and g_loss must stay within TOLERANCE (relative).
"""
import argparse
import glob
import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write  # noqa: E402
from throughput import run  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "models"))
PEAK_GFLOPS = {"fp32": 200.0, "bf16": 570.0}  # this machine's ceilings (issue 19: AVX-512 FMA, AMX)
TARGET_EVS = {"fp32": 2.0, "bf16": 5.0}
TOLERANCE = 0.10


def flops_per_event(files, batch, preset="full"):
    from torch.utils.flop_counter import FlopCounterMode

    import gan3d
    from mpilearn.data.hdf5 import EventFiles

    task = gan3d.build({"preset": preset})
    task.setup(None, "cpu", "mpi", 25 << 20, distributed=False)
    data = EventFiles(files, task.keys, task.optional_keys)
    sample = task.transform(data.read(np.arange(batch)))
    counter = FlopCounterMode(display=False)
    with counter:
        task.train_step(sample)
    return counter.get_total_flops() / batch


def loss_curves(files, steps, batch):
    import gan3d
    from mpilearn.data.hdf5 import EventFiles

    curves = {}
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        task = gan3d.build({"preset": "small"})
        task.setup(None, "cpu", "mpi", 25 << 20, distributed=False)
        task.precision = precision
        data = EventFiles(files, task.keys, task.optional_keys)
        n = len(data) - len(data) % batch
        rows = []
        for step in range(steps):
            start = (step * batch) % n
            out = task.train_step(task.transform(data.read(np.arange(start, start + batch))))
            rows.append((out["d_loss"], out["g_loss"]))
        curves[precision] = np.array(rows)
    return curves


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", default="fp32:off,bf16:off,fp32:default",
                    help="precision:compile pairs (compile: off or a torch.compile mode)")
    ap.add_argument("--preset", default="full", choices=("full", "small"))
    ap.add_argument("--steps", type=int, default=0, help="steps per epoch (default 3, --quick 1)")
    ap.add_argument("--no-curves", action="store_true", help="skip the bf16 loss-tracking part")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "gan_cpu"))
    a = ap.parse_args()
    from mpilearn.calo.simulate import simulate

    torch.set_num_threads(2)
    tmp = tempfile.mkdtemp(prefix="mpilearn-bench-")
    showers = os.path.join(tmp, "showers")
    simulate(showers, 256, "angle", (100, 200), 1, 4096, progress=False)
    files = sorted(glob.glob(os.path.join(showers, "*.h5")))
    per_event = flops_per_event(files, 8, a.preset)
    gan = os.path.join(REPO, "models", "gan3d.py")
    steps = a.steps or (1 if a.quick else 3)
    rows = []
    for pair in a.rows.split(","):
        precision, mode = pair.split(":")
        r = run(1, 8, steps, [f"model={gan}", f"data.files=[{showers}/*.h5]", f"hparams.preset={a.preset}",
                              f"train.precision={precision}", f"train.compile={mode}"], "mpi",
                env={"OMP_NUM_THREADS": "2"})
        evs = r["samples_per_s"]
        achieved = evs * per_event / 1e9
        rows.append({"precision": precision, "compile": mode, "preset": a.preset, "events_per_s": evs,
                     "target": TARGET_EVS[precision], "gflops": achieved,
                     "floor_fraction": achieved / PEAK_GFLOPS[precision], "ms_step": r["per_step_ms"],
                     "steps": steps})
        print(rows[-1], flush=True)
    curves = {} if a.no_curves else loss_curves(files, 40 if a.quick else 200, 8)
    data = {"rows": rows, "flops_per_event": per_event,
            "curves": {k: v.tolist() for k, v in curves.items()}}
    write(a.out, data, markdown(data))


def markdown(data, window=20):
    """The tables, from the JSON this script writes."""
    rows, per_event = data["rows"], data["flops_per_event"]
    curves = {k: np.asarray(v) for k, v in data["curves"].items()}
    steps = len(curves["fp32"]) if curves else 0
    preset = rows[0].get("preset", "full") if rows else "full"
    md = [f"`bench/gan_cpu.py`: mpilearn.train, 1 rank, 2 threads, batch 8, {preset} angle model, second epoch. "
          f"FLOPs from torch.utils.flop_counter over one training step (four updates, forward and backward): "
          f"{per_event / 1e9:.1f} GFLOP per event per step. Floor = this machine's ceiling "
          f"({PEAK_GFLOPS['fp32']:.0f} GFLOP/s fp32, {PEAK_GFLOPS['bf16']:.0f} GFLOP/s bf16).", "",
          "| precision | train.compile | events/s | target | verdict | achieved GFLOP/s | fraction of the FLOP floor |",
          "|---|---|---|---|---|---|---|"]
    md += [f"| {r['precision']} | {r.get('compile', 'off')} | {r['events_per_s']:.2f} | >= {r['target']:.0f} | "
           f"{'met' if r['events_per_s'] >= r['target'] else 'missed'} | {r['gflops']:.0f} | {r['floor_fraction']:.0%} |"
           for r in rows]
    if not curves:
        return md
    md += ["", f"bf16 vs fp32 loss curves, small preset, {steps} steps, same batches and initial weights "
           f"({window}-step windowed means; tolerance: every window within {TOLERANCE:.0%} of fp32's):", "",
           "| steps | d_loss fp32 | d_loss bf16 | gap | g_loss fp32 | g_loss bf16 | gap |", "|---|---|---|---|---|---|---|"]
    means = {p: c.reshape(-1, window, c.shape[1]).mean(1) for p, c in curves.items()}
    worst = 0.0
    for w in range(len(means["fp32"])):
        f, b = means["fp32"][w], means["bf16"][w]
        gaps = np.abs(b - f) / np.abs(f)
        worst = max(worst, float(gaps.max()))
        md.append(f"| {w * window}-{(w + 1) * window} | {f[0]:.2f} | {b[0]:.2f} | {gaps[0]:.1%} | "
                  f"{f[1]:.2f} | {b[1]:.2f} | {gaps[1]:.1%} |")
    md += ["", f"Largest gap {worst:.1%}: {'met' if worst <= TOLERANCE else 'missed'}."]
    return md


if __name__ == "__main__":
    main()
