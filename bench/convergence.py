"""Time-to-quality of the 3DGAN across rank counts (issue 35): does physics quality hold at scale?

Every run trains the same generator on the same simulated events for the same number of epochs,
so every run sees the same events; only how they are split over ranks changes:

    np=1  batch B, three seeds (the seed-to-seed spread)
    np=4  batch B per rank (global 4B), each large-batch rule (sqrt, linear; base_batch B,
          --warmup epochs)
    np=4  batch B per rank, lr_scaling none: what a naive user gets
    np=2  batch B per rank (global 2B), the best rule: the one whose np=4 run ends with the
          lowest score ratio (--rule picks one by hand)

Quality, every epoch, on held-out MC (``train.validate_every: 1``): the score ratio (score /
MC-vs-MC floor, 1 = as good as the MC), the sampling-fraction MRE and the reference metric over
the cells the MC fills. Time-to-quality: the training wall time (epoch ``time.seconds``,
validation not counted) at which the score ratio first falls to the threshold, which is the
worst final score ratio among the np=1 seeds: a quality every np=1 seed reaches, so np=1's
time-to-quality is defined for each seed, and a run that never reaches it says "not reached".

Resumable: each run is its own run directory under OUT/runs (git-ignored); a finished one is read, not run
again, and an interrupted one continues with --resume auto. Data are simulated once into
OUT/runs/data.

    python bench/convergence.py --quick                       # <= 3 min on 2 cores
    python bench/convergence.py                               # the full CPU run (~60 min)
    python bench/convergence.py --device cuda --preset full   # a GPU machine

Writes OUT.json / OUT.md (the table) and OUT_events.png / OUT_time.png (score ratio against
events seen and against wall time); OUT defaults to bench/results/convergence.
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

from common import RESULTS, write  # noqa: E402

PRESETS = {  # events, validation events, epochs, per-rank batch, physics events
    "quick": dict(events=64, val=32, epochs=2, batch=4, physics=16, preset="small"),
    "cpu": dict(events=1024, val=512, epochs=6, batch=8, physics=256, preset="small"),
    "full": dict(events=16384, val=4096, epochs=10, batch=32, physics=2000, preset="full"),
}


RULES = ("sqrt", "linear")
SEEDS, MOST_SEEDS = 3, 6  # np=1 seeds that train to the end (a collapsed seed is replaced)


def np4_runs(rules, warmup: float) -> list:
    """(name, ranks, seed, lr_scaling, warmup) of the np=4 runs, in the order they run."""
    return [(f"np4-{rule}", 4, 0, rule, warmup) for rule in rules] + \
        [("np4-naive", 4, 0, "none", 0.0)]


def best_rule(curves: dict, rules) -> str:
    """The rule whose np=4 run ends closest to the MC (lowest final score ratio; a collapsed
    run last)."""
    return min(rules, key=lambda rule: curves[f"np4-{rule}"][-1]["score_ratio"]
               if f"np4-{rule}" in curves else float("inf"))


def simulate_data(folder: str, p: dict) -> tuple:
    from mpilearn.calo.simulate import simulate

    train, val = os.path.join(folder, "train"), os.path.join(folder, "val")
    if not glob.glob(f"{train}/*.h5"):
        simulate(train, p["events"], "angle", (100, 200), 1, p["events"], progress=False)
    if not glob.glob(f"{val}/*.h5"):
        simulate(val, p["val"], "angle", (100, 200), 2, p["val"], progress=False)
    return sorted(glob.glob(f"{train}/*.h5")), sorted(glob.glob(f"{val}/*.h5"))


def epochs_of(out: str) -> list:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [r for r in map(json.loads, open(path)) if "time" in r]


COLLAPSED = "collapsed.txt"  # in a run directory: the guard's message (a result, not a crash)


def train(name, ranks, seed, rule, warmup, p, files, val, args, folder):
    """The run's epoch records, or the message of the generator's empty-image guard when the
    run collapsed (exit 3: the generator emitted only empty images; a GAN outcome to report)."""
    out = os.path.join(folder, "runs", name)
    done = epochs_of(out)
    if len(done) >= p["epochs"]:
        print(f"{name}: done earlier, read from {out}", flush=True)
        return done
    if os.path.exists(os.path.join(out, COLLAPSED)):
        print(f"{name}: collapsed earlier, read from {out}", flush=True)
        return open(os.path.join(out, COLLAPSED)).read().strip()
    sets = {"model": os.path.join(REPO, "models", "gan3d.py"), "hparams.preset": p["preset"],
            "hparams.seed": seed, "train.seed": seed, "data.files": "[" + ",".join(files) + "]",
            "data.val_files": "[" + ",".join(val) + "]", "train.epochs": p["epochs"],
            "train.batch_size": p["batch"], "train.validate_every": 1,
            "train.physics_events": p["physics"], "train.lr_scaling": rule,
            "train.base_batch": p["batch"], "train.warmup_epochs": warmup,
            "train.best.monitor": "none", "device.type": args.device,
            "device.allow_shared_gpus": True}
    cmd = ["mpirun", "-np", str(ranks), "--oversubscribe", sys.executable, "-m", "mpilearn.train",
           "--no-progress", "--output", out, "--resume", "auto"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // ranks)),
           "TQDM_DISABLE": "1"}
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    guard = [line for line in (proc.stdout + proc.stderr).splitlines() if "emitted empty images" in line]
    if proc.returncode == 3 and guard:
        message = f"collapsed in epoch {len(epochs_of(out)) + 1}: {guard[0].split(': ', 1)[-1]}"
        with open(os.path.join(out, COLLAPSED), "w") as f:
            f.write(message + "\n")
        print(f"{name}: {message}", flush=True)
        return message
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"{name}: training failed (exit {proc.returncode})")
    print(f"{name}: {time.time() - start:.0f} s", flush=True)
    return epochs_of(out)


def curve(records: list, events: int) -> list:
    """Per epoch: events seen, cumulative training seconds, the quality numbers."""
    out, seconds = [], 0.0
    for r in records:
        seconds += r["time"]["seconds"]
        out.append({"epoch": r["epoch"], "events_seen": r["epoch"] * events,
                    "seconds": round(seconds, 2), "lr": r["lr"],
                    **{k: r.get(k) for k in ("score", "score_floor", "score_ratio",
                                             "sampling_fraction_mre", "reference_metric_filled")}})
    return out


def time_to(points: list, threshold: float):
    for pt in points:
        if pt["score_ratio"] is not None and pt["score_ratio"] <= threshold:
            return pt["seconds"]
    return None


def summarise(curves: dict, collapsed: dict, rule: str) -> dict:
    import numpy as np

    finals = [c[-1]["score_ratio"] for name, c in curves.items() if name.startswith("np1-")]
    threshold = max(finals)
    mean, spread = float(np.mean(finals)), (min(finals), max(finals))
    band = max(spread[1] - mean, mean - spread[0], 0.1 * mean)
    rows = {}
    for name, c in curves.items():
        rows[name] = {"final_score_ratio": c[-1]["score_ratio"],
                      "final_sampling_fraction_mre": c[-1]["sampling_fraction_mre"],
                      "final_reference_metric_filled": c[-1]["reference_metric_filled"],
                      "seconds": c[-1]["seconds"], "time_to_quality": time_to(c, threshold),
                      "within_np1_spread": abs(c[-1]["score_ratio"] - mean) <= band}
    np1_ttq = float(np.mean([r["time_to_quality"] for n, r in rows.items() if n.startswith("np1-")]))
    np2 = rows.get(f"np2-{rule}", {})
    np4 = rows.get(f"np4-{rule}", {})
    return {"threshold": threshold, "np1_mean": mean, "np1_spread": spread, "band": band,
            "rows": rows, "collapsed": collapsed, "np1_time_to_quality": np1_ttq,
            "np4_within_np1_spread": np4.get("within_np1_spread"),
            "ttq_ratio_np2_over_np1": (np2["time_to_quality"] / np1_ttq
                                       if np2.get("time_to_quality") else None)}


def plot(curves: dict, threshold: float, out: str) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for x, xlabel, suffix in (("events_seen", "events seen (training events × epochs)", "events"),
                              ("seconds", "training wall time (s, validation not counted)", "time")):
        fig, ax = plt.subplots(figsize=(8, 5))
        for name, c in curves.items():
            style = ":" if name.startswith("np1-") else ("--" if "naive" in name else "-")
            ax.plot([p[x] for p in c], [p["score_ratio"] for p in c], style, marker="o", label=name)
        ax.axhline(threshold, color="0.5", lw=1, label=f"threshold {threshold:.2f} (worst np=1 final)")
        ax.axhline(1.0, color="k", lw=0.8, ls="-.", label="MC-vs-MC floor (ratio 1)")
        ax.set(xlabel=xlabel, ylabel="score ratio (score / MC-vs-MC floor, dimensionless)",
               yscale="log", title="3DGAN physics quality against " + suffix)
        ax.legend(fontsize=10)
        fig.tight_layout()
        path = f"{out}_{suffix}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def markdown(s: dict, args, p: dict) -> list:
    def f(v, fmt=".3g"):
        return "n/a" if v is None else format(v, fmt)

    lines = [f"Convergence at equal events seen ({p['events']} training events × {p['epochs']} "
             f"epochs, batch {p['batch']} per rank, preset {p['preset']}, {args.device}; "
             f"warm-up {args.warmup} epochs, base_batch {p['batch']}; the np=2 run uses "
             f"{args.rule}, {args.chosen}). Threshold: "
             f"score ratio {s['threshold']:.3f}, the worst final np=1 score ratio.", "",
             "| run | final score ratio | within np=1 spread | sampling_fraction_mre | "
             "reference_metric_filled | train seconds | time to threshold (s) |",
             "|---|---|---|---|---|---|---|"]
    for name, r in s["rows"].items():
        ttq = r["time_to_quality"]
        lines.append(f"| {name} | {f(r['final_score_ratio'])} | "
                     f"{'yes' if r['within_np1_spread'] else 'no'} | "
                     f"{f(r['final_sampling_fraction_mre'])} "
                     f"| {f(r['final_reference_metric_filled'])} | {r['seconds']:.1f} | "
                     f"{f(ttq, '.1f') if ttq is not None else 'not reached'} |")
    for name, message in s["collapsed"].items():
        lines.append(f"| {name} | {message} | | | | | |")
    lines += ["", f"np=1 final score ratio: mean {s['np1_mean']:.3f}, range "
                  f"{s['np1_spread'][0]:.3f}-{s['np1_spread'][1]:.3f} (band ±{s['band']:.3f}: the "
                  f"spread or 10 % of the mean); np=4 ({args.rule}) within it: "
                  f"{s['np4_within_np1_spread']}; time-to-quality np=2 / np=1 (mean "
                  f"{s['np1_time_to_quality']:.1f} s): {f(s['ttq_ratio_np2_over_np1'])}"]
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (<= 3 min on 2 cores)")
    ap.add_argument("--preset", choices=("small", "full"), default=None,
                    help="full: the full 3DGAN at GPU sizes (default: small, CPU sizes)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--rule", default="best", choices=("best",) + RULES,
                    help="the large-batch rule of the np=2 run (default: the best at np=4)")
    ap.add_argument("--warmup", type=float, default=1.0, help="warm-up epochs of the rule")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="CPU threads shared by a run's ranks")
    ap.add_argument("--out", default=None, help="results prefix (default bench/results/convergence"
                    "[_quick]); runs and data in OUT/")
    args = ap.parse_args()
    p = dict(PRESETS["quick" if args.quick else ("full" if args.preset == "full" else "cpu")])
    out = args.out or os.path.join(RESULTS, "convergence" + ("_quick" if args.quick else ""))
    os.makedirs(out, exist_ok=True)
    files, val = simulate_data(os.path.join(out, "runs", "data"), p)  # runs/: git-ignored
    curves, collapsed = {}, {}

    def run(name, ranks, seed, rule, warmup):
        got = train(name, ranks, seed, rule, warmup, p, files, val, args, out)
        if isinstance(got, str):
            collapsed[name] = got
        else:
            curves[name] = curve(got, p["events"])

    seed = 0
    while sum(n.startswith("np1-") for n in curves) < SEEDS and seed < MOST_SEEDS:
        run(f"np1-seed{seed}", 1, seed, "none", 0.0)
        seed += 1
    rules = RULES if args.rule == "best" else (args.rule,)
    args.chosen = ("the rule whose np=4 run ended with the lowest score ratio"
                   if args.rule == "best" else "given by --rule")
    for spec in np4_runs(rules, args.warmup):
        run(*spec)
    args.rule = best_rule(curves, rules)
    print(f"the best rule at np=4: {args.rule}", flush=True)
    run(f"np2-{args.rule}", 2, 0, args.rule, args.warmup)
    s = summarise(curves, collapsed, args.rule)
    plots = plot(curves, s["threshold"], out)
    write(out, {"config": {**p, **vars(args)}, "curves": curves, "summary": s, "plots": plots},
          markdown(s, args, p))


if __name__ == "__main__":
    main()
