"""Throughput of allreduce vs downpour vs EASGD at np=3, with and without one 5x slower rank.

    python bench/async_training.py [--quick] [--out bench/results/async_training]

The workload is the supervised example (models/mlp.py) with a fixed pause per step standing
in for compute (tests/models/slow.py: 20 ms; the straggler, rank 2, pauses 5x as long), so
the numbers show the algorithms, not this machine's 2 cores. allreduce trains on all 3 ranks;
downpour and EASGD on 2 workers with rank 0 as the master. Each case runs the real CLI for
3 epochs and reports the last: samples/s over all ranks, the steps each worker did, staleness.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from common import write

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
       "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
ALGORITHMS = {"allreduce": [], "downpour": ["train.algorithm=downpour"],
              "easgd": ["train.algorithm=easgd", "train.sync_every=4"]}


def run(toy, algorithm, straggler):
    out = tempfile.mkdtemp(prefix="mpilearn-async-")
    sets = [f"model={REPO}/tests/models/slow.py", f"data.files=[{toy}]", "train.epochs=3",
            "train.batch_size=32", "hparams.sleep=0.02", f"hparams.straggler={straggler}",
            "data.val_fraction=0.05", *ALGORITHMS[algorithm]]
    cmd = ["mpirun", "-np", "3", "--oversubscribe", sys.executable, "-m", "mpilearn.train",
           "--no-progress", "--output", out] + [x for s in sets for x in ("--set", s)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    last = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))][-1]
    info = last.get("async", {})
    return {"algorithm": algorithm, "straggler": straggler >= 0, "samples_per_s": last["samples_per_s"],
            "val_loss": last["val_loss"], "steps_per_worker": info.get("steps_per_worker"),
            "staleness_mean": info.get("staleness_mean"), "staleness_max": info.get("staleness_max")}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "async_training"))
    a = p.parse_args()
    from mpilearn.data.toy import write_regression

    events = 4096 if a.quick else 16384
    toy = write_regression(os.path.join(tempfile.mkdtemp(), "toy.h5"), events=events)
    rows = [run(toy, alg, straggler) for straggler in (-1, 2) for alg in ALGORITHMS]
    base = {r["algorithm"]: r["samples_per_s"] for r in rows if not r["straggler"]}
    md = ["| algorithm | slow rank (5x) | samples/s | vs same algorithm, no straggler | steps per worker | staleness mean / max | val loss |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        steps = "all ranks in lockstep" if r["steps_per_worker"] is None else str(r["steps_per_worker"])
        stale = "-" if r["staleness_mean"] is None else f"{r['staleness_mean']:.2f} / {r['staleness_max']}"
        md.append(f"| {r['algorithm']} | {'rank 2' if r['straggler'] else 'none'} | "
                  f"{r['samples_per_s']:.0f} | {r['samples_per_s'] / base[r['algorithm']]:.2f} | "
                  f"{steps} | {stale} | {r['val_loss']:.4f} |")
    md += ["", "np=3; a step pauses 20 ms (100 ms on the slow rank) on top of the MLP's compute; "
           "global rate from the master's (rank 0's) wall clock, last of 3 epochs."]
    write(a.out, rows, md)


if __name__ == "__main__":
    main()
