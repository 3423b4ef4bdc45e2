"""Training throughput of mpilearn.train at np=1 and np=2, with the per-rank time split.

    python bench/throughput.py [--quick] [--out bench/results/throughput]

Each case runs the real CLI under mpirun for 2 epochs and reports the second (the first pays
for start-up). Supervised cases also run the peer, plain PyTorch DDP with gloo
(bench/ddp_peer.py), on the same model file and data (its allreduce hides inside backward,
so only its total and data wait are reported). Same global batch at np=1 and np=2 (the local batch is halved), so samples/s
compare like for like. Writes JSON and a Markdown table.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

from common import write

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
       "TQDM_DISABLE": "1"}


def cases(quick):
    from mpilearn.data.toy import write_regression
    from mpilearn.calo.simulate import simulate

    tmp = tempfile.mkdtemp(prefix="mpilearn-bench-")
    toy = write_regression(os.path.join(tmp, "toy.h5"), events=32768)
    showers = os.path.join(tmp, "showers")
    one = simulate(showers, 256 if quick else 1024, "angle", (100, 200), 1, 4096, progress=False)[0]
    gan = os.path.join(REPO, "models", "gan3d.py")
    mlp = f"{REPO}/models/mlp.py"
    yield ("mlp (supervised example)", 256, 64 if quick else 0,
           [f"model={mlp}", f"data.files=[{toy}]"], (mlp, toy))
    calo = f"{REPO}/bench/models/calo_regressor.py"
    yield ("3DGAN D as energy regressor", 16, 4 if quick else 16,
           [f"model={calo}", f"data.files=[{one}]"], (calo, one))
    yield ("3DGAN small preset", 32, 4 if quick else 16,
           [f"model={gan}", f"data.files=[{showers}/*.h5]", "hparams.preset=small"], None)
    yield ("3DGAN full angle model", 4, 1 if quick else 3,
           [f"model={gan}", f"data.files=[{showers}/*.h5]", "hparams.preset=full"], None)


def run(np_, global_batch, steps, sets, backend, env=None):
    out = tempfile.mkdtemp(prefix="mpilearn-run-")
    args = ["mpirun", "-np", str(np_), "--oversubscribe", sys.executable, "-m", "mpilearn.train",
            "--no-progress", "--output", out, "--set", "train.epochs=2",
            "--set", f"train.batch_size={global_batch // np_}", "--set", f"train.backend={backend}",
            "--set", "data.val_fraction=0.0", "--set", f"train.max_steps_per_epoch={steps}"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, capture_output=True, text=True, env={**ENV, **(env or {})}, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    last = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))][-1]
    steps_done = last["step"] // 2
    t = last["time"]
    return {"np": np_, "backend": backend, "global_batch": global_batch, "steps": steps_done,
            "samples_per_s": last["samples_per_s"],
            "per_step_ms": {k: 1000 * t[k] / steps_done for k in ("compute", "allreduce", "data", "seconds")},
            "time_per_rank": last["time_per_rank"]}


def run_ddp(np_, global_batch, steps, peer):
    """The same supervised model and data under plain PyTorch DDP (bench/ddp_peer.py)."""
    out = tempfile.mktemp(suffix=".json")
    steps = steps or 64
    args = ["mpirun", "-np", str(np_), "--oversubscribe", sys.executable,
            os.path.join(REPO, "bench", "ddp_peer.py"), peer[0], peer[1], str(global_batch), str(steps), out]
    proc = subprocess.run(args, capture_output=True, text=True, env=ENV, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    r = json.load(open(out))
    ms = r["per_step_ms"]
    return {"np": np_, "backend": "ddp (peer)", "global_batch": global_batch, "steps": steps,
            "samples_per_s": r["samples_per_s"],
            "per_step_ms": {"compute": ms["seconds"] - ms["data"], "allreduce": float("nan"),
                            "data": ms["data"], "seconds": ms["seconds"]}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--backends", default="mpi")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "throughput"))
    a = p.parse_args()
    rows = []
    for name, gb, steps, sets, peer in cases(a.quick):
        for backend in a.backends.split(",") + (["ddp"] if peer else []):
            for np_ in (1, 2):
                r = run_ddp(np_, gb, steps, peer) if backend == "ddp" else run(np_, gb, steps, sets, backend)
                r["case"] = name
                rows.append(r)
                print(f"{name:28s} np={np_} {backend:6s} {r['samples_per_s']:9.2f} samples/s", flush=True)
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "python": platform.python_version()}
    write(a.out, {"meta": meta, "rows": rows}, markdown(rows))


def markdown(rows):
    lines = ["| case | np | backend | global batch | samples/s | ms/step compute | allreduce | data wait "
             "| data wait % of step |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["per_step_ms"]
        lines.append(f"| {r['case']} | {r['np']} | {r['backend']} | {r['global_batch']} | "
                     f"{r['samples_per_s']:.2f} | {s['compute']:.1f} | {s['allreduce']:.1f} | {s['data']:.1f} "
                     f"| {100 * s['data'] / s['seconds']:.2f} |")
    gan = [r for r in rows if r["case"].startswith(("3DGAN small", "3DGAN full"))]
    waits = [100 * r["per_step_ms"]["data"] / r["per_step_ms"]["seconds"]
             for r in gan if r["np"] == 2 and r["backend"] == "mpi"]
    if waits:
        lines += ["", f"Target: data wait <= 1 % of a step for the small and full 3DGAN at np=2 (mpi): "
                  f"{', '.join(f'{w:.2f} %' for w in waits)}: {'met' if max(waits) <= 1 else 'missed'}."]
    return lines


if __name__ == "__main__":
    main()
