"""The small 3DGAN preset in Keras 3 (TensorFlow and torch backends) vs PyTorch, np=1 and 2.

    python bench/keras_throughput.py [--quick] [--out bench/results/keras_throughput]

Same simulated showers, global batch 32 (16 per rank at np=2), 2 epochs of the real CLI, the
second reported; per-step time split of rank 0.
"""
import argparse
import os
import tempfile

from common import write
from throughput import REPO, run

CASES = [("PyTorch (models/gan3d.py)", "gan3d.py", {}),
         ("Keras 3 on TensorFlow (models/gan3d_keras.py)", "gan3d_keras.py",
          {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"}),
         ("Keras 3 on torch (models/gan3d_keras.py)", "gan3d_keras.py", {"KERAS_BACKEND": "torch"})]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "keras_throughput"))
    a = p.parse_args()
    from mpilearn.calo.simulate import simulate

    showers = os.path.join(tempfile.mkdtemp(prefix="mpilearn-bench-"), "showers")
    simulate(showers, 256 if a.quick else 1024, "angle", (100, 200), 1, 4096, progress=False)
    steps = 4 if a.quick else 16
    rows = []
    for name, model, env in CASES:
        for np_ in (1, 2):
            sets = [f"model={REPO}/models/{model}", f"data.files=[{showers}/*.h5]", "hparams.preset=small"]
            r = run(np_, 32, steps, sets, "mpi", env)
            r["case"] = name
            rows.append(r)
            print(f"{name:45s} np={np_} {r['samples_per_s']:8.2f} samples/s", flush=True)
    torch_rate = {r["np"]: r["samples_per_s"] for r in rows if r["case"].startswith("PyTorch")}
    lines = ["| implementation | np | samples/s | vs PyTorch | ms/step compute | allreduce | data wait |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["per_step_ms"]
        lines.append(f"| {r['case']} | {r['np']} | {r['samples_per_s']:.2f} | "
                     f"{r['samples_per_s'] / torch_rate[r['np']]:.2f} | {s['compute']:.1f} | "
                     f"{s['allreduce']:.1f} | {s['data']:.1f} |")
    lines += ["", f"Small 3DGAN preset, global batch 32, {steps} steps per epoch, second of 2 epochs."]
    write(a.out, rows, lines)


if __name__ == "__main__":
    main()
