"""What elastic training costs (``train.elastic``, Open MPI's ULFM).

    python bench/elastic.py [OUT] [--sizes 2,4] [--recovery-sizes 2,4,8,16] [--repeats 3]
                            [--events 32768] [--hidden 256] [--batch 64]
    python bench/elastic.py OUT --sizes "" --recovery-sizes 16   # the 16-rank recovery rows only

1. Cost when nothing fails: the same MLP training, elastic off (plain ``mpirun``) and on
   (``mpirun --with-ft ulfm``, ``train.elastic.min_ranks=1``, a snapshot every step),
   alternated ``--repeats`` times at each of ``--sizes``; step time is the second epoch's training
   seconds per step (the first pays the start-up); the ratio on/off of the medians. The
   snapshot's size is the run's own line ("MiB each").
2. Recovery: at each of ``--recovery-sizes`` (oversubscribed, one thread per rank, where the
   machine has fewer cores), the victim rank 0 and then the last rank kills itself with SIGKILL
   at a step in the first epoch, writing the time first; recovery is from that time to the end
   of the survivors' first step (``metrics.jsonl``), and the survivors' own revoke + shrink +
   agree. Work lost: the steps the survivors went back (at most the step in flight with a
   snapshot every step).

3. ``--chaos``: only the chaos run (``bench/elastic_chaos.py``): ``--chaos-ranks`` 8 with
   ``train.elastic.min_ranks`` ``--chaos-min`` 4, a random live rank killed -9 from outside every
   ``--chaos-every`` seconds (``--chaos-kills``, ``--chaos-seed``); it must finish, with weights
   equal to the stop-and-resume replay at the recorded steps and sizes.

Writes OUT.json and OUT.md (default bench/results/elastic; bench/results/elastic-chaos).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, write  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODEL = os.path.join(HERE, "models", "elastic_probe.py")
ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
       "OMPI_MCA_mpi_yield_when_idle": "1", "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}


def train(np_, out, data, args, elastic: bool, env=None, epochs=2):
    """One training run; returns (completed process, metrics records)."""
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe"]
    if elastic:
        cmd[1:1] = ["--with-ft", "ulfm"]
    for k in env or {}:
        cmd += ["-x", k]
    cmd += [sys.executable, "-m", "mpilearn.train", "--no-progress", "--output", out,
            "--set", f"model={MODEL}", "--set", f"data.files=[{data}]",
            "--set", f"train.epochs={epochs}", "--set", f"train.batch_size={args.batch}",
            "--set", f"hparams.hidden={args.hidden}", "--set", "data.val_fraction=0.01"]
    if elastic:
        cmd += ["--set", "train.elastic.min_ranks=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                          env={**ENV, **(env or {})}, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return proc, [json.loads(line) for line in f]


def step_seconds(records) -> float:
    """Training seconds per step of the last epoch."""
    epochs = [r for r in records if "time" in r]
    steps = epochs[-1]["step"] - (epochs[-2]["step"] if len(epochs) > 1 else 0)
    return epochs[-1]["time"]["seconds"] / steps


def overhead(args, data, tmp) -> list:
    rows = []
    for n in args.sizes:
        off, on, mib = [], [], None
        for k in range(args.repeats):
            for elastic, times in ((False, off), (True, on)):
                out = os.path.join(tmp, f"cost-np{n}-{int(elastic)}-{k}")
                proc, records = train(n, out, data, args, elastic)
                times.append(step_seconds(records))
                found = re.search(r"([\d.e+-]+) MiB each", proc.stdout)
                mib = float(found.group(1)) if found else mib
        ratio = statistics.median(on) / statistics.median(off)
        rows.append({"ranks": n, "off_s": statistics.median(off), "on_s": statistics.median(on),
                     "ratio": ratio, "snapshot_mib": mib, "off_all": off, "on_all": on})
    return rows


def recovery(args, data, tmp) -> list:
    rows = []
    for n in args.recovery_sizes:
        for victim in (0, n - 1):
            out = os.path.join(tmp, f"rec-np{n}-v{victim}")
            stamp = os.path.join(tmp, f"stamp-np{n}-v{victim}")
            env = {"MPILEARN_BENCH_KILL": f"{victim}:{args.kill_step}",
                   "MPILEARN_BENCH_KILL_STAMP": stamp}
            if n > (os.cpu_count() or 1):  # oversubscribed: ranks that share cores, one thread
                env["OMP_NUM_THREADS"] = "1"
            _, records = train(n, out, data, args, True, env, epochs=1)
            killed = float(open(stamp).read())
            change = next(r for r in records if "membership" in r)
            first = next(r for r in records if "first_step_after_loss_at" in r)
            rows.append({"ranks": n, "victim": victim,
                         "recovery_s": first["first_step_after_loss_at"] - killed,
                         "detect_s": change["membership"]["detected_at"] - killed,
                         "shrink_agree_s": change["membership"]["recovery_s"],
                         "steps_lost": args.kill_step - change["step"],
                         "step_s": step_seconds(records)})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", nargs="?", default=os.path.join(RESULTS, "elastic"))
    p.add_argument("--sizes", default="2,4")
    p.add_argument("--recovery-sizes", default="2,4,8,16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--events", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--kill-step", type=int, default=10)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--chaos", action="store_true", help="only the chaos run")
    p.add_argument("--chaos-ranks", type=int, default=8)
    p.add_argument("--chaos-min", type=int, default=4)
    p.add_argument("--chaos-kills", type=int, default=4)
    p.add_argument("--chaos-every", default="3,6", help="seconds between kills: LOW,HIGH")
    p.add_argument("--chaos-seed", type=int, default=0)
    p.add_argument("--chaos-events", type=int, default=2048)
    p.add_argument("--chaos-epochs", type=int, default=4)
    p.add_argument("--chaos-batch", type=int, default=4)
    p.add_argument("--chaos-sleep", type=float, default=0.1, help="pause per step (s)")
    args = p.parse_args()
    if args.chaos:
        return run_chaos(args)
    args.sizes = [int(x) for x in args.sizes.split(",") if x]
    args.recovery_sizes = [int(x) for x in args.recovery_sizes.split(",") if x]
    from mpilearn.data.toy import write_regression

    with tempfile.TemporaryDirectory(prefix="elastic-bench-") as tmp:
        data = write_regression(os.path.join(tmp, "toy.h5"), events=args.events)
        began = time.time()
        cost, rec = overhead(args, data, tmp), recovery(args, data, tmp)
    md = []
    if cost:  # (--sizes "": the recovery rows only)
        md += ["## Elastic training: cost when nothing fails (step time, medians of "
               f"{args.repeats}, MLP hidden {args.hidden}, batch {args.batch}/rank)", "",
               "| ranks | off s/step | on s/step | on/off | snapshot MiB |",
               "|---|---|---|---|---|"]
        md += [f"| {r['ranks']} | {r['off_s']:.5f} | {r['on_s']:.5f} | {r['ratio']:.3f} | "
               f"{r['snapshot_mib']} |" for r in cost]
        md += [""]
    md += ["## Recovery from kill -9 (to the end of the survivors' first step)", "",
           "| ranks | victim | recovery s | detected after s | revoke+shrink+agree s | "
           "steps lost | s/step |", "|---|---|---|---|---|---|---|"]
    md += [f"| {r['ranks']} | {r['victim']} | {r['recovery_s']:.3f} | {r['detect_s']:.3f} | "
           f"{r['shrink_agree_s']:.4f} | {r['steps_lost']} | {r['step_s']:.4f} |" for r in rec]
    md += ["", f"({time.time() - began:.0f} s in all)"]
    write(args.out, {"overhead": cost, "recovery": rec, "args": vars(args)}, md)


def run_chaos(args):
    import elastic_chaos
    from mpilearn.data.toy import write_regression

    args.chaos_every = tuple(float(x) for x in args.chaos_every.split(","))
    out = args.out if args.out != os.path.join(RESULTS, "elastic") else args.out + "-chaos"
    with tempfile.TemporaryDirectory(prefix="elastic-chaos-") as tmp:
        data = write_regression(os.path.join(tmp, "toy.h5"), events=args.chaos_events)
        row = elastic_chaos.chaos(args, data, tmp, {**ENV, "OMP_NUM_THREADS": "1"})
    write(out, {"chaos": row, "args": vars(args)}, elastic_chaos.markdown(row))
    if row["exit"] != 0 or not row["equal"] or not row["seen_exact"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
