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

``--preset smooth`` (issue 49): the CPU preset near the MC, with the CaloChallenge metrics too:
FPD (its ratio to the MC-vs-MC floor, every epoch) and the high-level classifier AUC (every
second epoch); np=1 (three seeds), np=4 and np=2 with one rule (``--rule``, linear by default:
issue 35's choice), no naive run; each run trains at least 60 CPU-minutes (2 048 events x 10
epochs). Time-to-quality is read on each of score ratio, FPD ratio and AUC, each against the worst
final np=1 value, in training wall time and in CPU-seconds (every process of the run, launcher
included, summed over its invocations). ``--set KEY=VALUE`` goes to every run (the sweep's
chosen point: ``--set hparams.lr=...``).

Resumable: each run is its own run directory under OUT/runs (git-ignored); a finished one is read, not run
again, and an interrupted one continues with --resume auto. Data are simulated once into
OUT/runs/data.

    python bench/convergence.py --quick                       # <= 3 min on 2 cores
    python bench/convergence.py                               # the full CPU run (~60 min)
    python bench/convergence.py --preset smooth               # issue 49: ~6.3 CPU-hours
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
    "full": dict(events=16384, val=4096, epochs=10, batch=32, physics=2000, preset="full",
                 classifier_every=2),
    "smooth": dict(events=2048, val=512, epochs=10, batch=16, physics=256, preset="smooth",
                   classifier_every=2, rule="linear", naive=False),
}
METRICS = ("score_ratio", "fpd_sigma", "auc_high")  # time-to-quality is read on each


RULES = ("sqrt", "linear")
SEEDS, MOST_SEEDS = 3, 6  # np=1 seeds that train to the end (a collapsed seed is replaced)


def np4_runs(rules, warmup: float, naive: bool = True) -> list:
    """(name, ranks, seed, lr_scaling, warmup) of the np=4 runs, in the order they run."""
    return [(f"np4-{rule}", 4, 0, rule, warmup) for rule in rules] + \
        ([("np4-naive", 4, 0, "none", 0.0)] if naive else [])


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
            "device.allow_shared_gpus": True,
            "train.classifier_every": p.get("classifier_every", 0),
            **dict(kv.split("=", 1) for kv in args.set)}
    cmd = ["mpirun", "-np", str(ranks), "--oversubscribe", sys.executable, "-m", "mpilearn.train",
           "--no-progress", "--output", out, "--resume", "auto"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // ranks)),
           "TQDM_DISABLE": "1"}
    start, cpu = time.time(), _children_cpu()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    _add_cpu(out, _children_cpu() - cpu)
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


CPU_FILE = "cpu_seconds.txt"  # in a run directory: CPU-seconds of its invocations, summed


def _children_cpu() -> float:
    """CPU-seconds of this process's ended descendants (mpirun waits for its ranks)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _add_cpu(out: str, seconds: float) -> None:
    path = os.path.join(out, CPU_FILE)
    before = float(open(path).read()) if os.path.exists(path) else 0.0
    with open(path, "w") as f:
        f.write(f"{before + seconds:.1f}\n")


def cpu_is_partial(folder: str) -> bool:
    """True when a launch of the run ended without an exit (killed, or its machine restarted):
    its ranks' CPU never reached CPU_FILE, which is then a lower bound."""
    path = os.path.join(folder, "launches.jsonl")
    if not os.path.exists(path):
        return False
    return any(json.loads(line).get("exit") is None for line in open(path) if line.strip())


def curve(records: list, events: int) -> list:
    """Per epoch: events seen, cumulative training seconds, the quality numbers."""
    out, seconds = [], 0.0
    for r in records:
        seconds += r["time"]["seconds"]
        out.append({"epoch": r["epoch"], "events_seen": r["epoch"] * events,
                    "seconds": round(seconds, 2), "lr": r["lr"],
                    **{k: r.get(k) for k in ("score", "score_floor", "score_ratio",
                                             "sampling_fraction_mre", "reference_metric_filled",
                                             "fpd", "fpd_error", "fpd_sigma", "kpd_sigma",
                                             "auc_high", "auc_high_error", "auc_high_floor")}})
    return out


def final(points: list, key: str):
    """The last value of ``key`` (the classifier's AUC is measured every few epochs only)."""
    values = [pt.get(key) for pt in points if pt.get(key) is not None]
    return values[-1] if values else None


def time_to(points: list, threshold, key: str = "score_ratio"):
    for pt in points:
        if threshold is not None and pt.get(key) is not None and pt[key] <= threshold:
            return pt["seconds"]
    return None


def summarise(curves: dict, collapsed: dict, rule: str, cpu: dict = None) -> dict:
    import numpy as np

    finals = [c[-1]["score_ratio"] for name, c in curves.items() if name.startswith("np1-")]
    mean, spread = float(np.mean(finals)), (min(finals), max(finals))
    band = max(spread[1] - mean, mean - spread[0], 0.1 * mean)
    # each metric's threshold: its worst final np=1 value
    thresholds = {key: max((v for v in (final(c, key) for n, c in curves.items()
                                        if n.startswith("np1-")) if v is not None), default=None)
                  for key in METRICS}
    threshold = thresholds["score_ratio"]
    rows = {}
    for name, c in curves.items():
        rows[name] = {"final_score_ratio": c[-1]["score_ratio"],
                      "final_sampling_fraction_mre": c[-1]["sampling_fraction_mre"],
                      "final_reference_metric_filled": c[-1]["reference_metric_filled"],
                      "final_fpd_sigma": final(c, "fpd_sigma"),
                      "final_auc_high": final(c, "auc_high"),
                      "cpu_seconds": (cpu or {}).get(name),
                      **{f"time_to_{key}": time_to(c, thresholds[key], key)
                         for key in METRICS[1:]},
                      "seconds": c[-1]["seconds"], "time_to_quality": time_to(c, threshold),
                      "within_np1_spread": abs(c[-1]["score_ratio"] - mean) <= band}
    np1_ttq = float(np.mean([r["time_to_quality"] for n, r in rows.items() if n.startswith("np1-")]))
    np2 = rows.get(f"np2-{rule}", {})
    np4 = rows.get(f"np4-{rule}", {})
    return {"threshold": threshold, "thresholds": thresholds, "np1_mean": mean,
            "np1_spread": spread, "band": band,
            "rows": rows, "collapsed": collapsed, "np1_time_to_quality": np1_ttq,
            "np4_within_np1_spread": np4.get("within_np1_spread"),
            "ttq_ratio_np2_over_np1": (np2["time_to_quality"] / np1_ttq
                                       if np2.get("time_to_quality") else None)}


LABELS = {"score_ratio": "score ratio (score / MC-vs-MC floor)",
          "fpd_sigma": "FPD distance from its MC-vs-MC floor (σ)",
          "auc_high": "high-level classifier AUC (0.5: like the MC)"}


def plot(curves: dict, thresholds: dict, out: str) -> list:
    """Per x axis (events seen, training wall time) one figure, a panel per metric measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in METRICS if any(final(c, k) is not None for c in curves.values())]
    paths = []
    for x, xlabel, suffix in (("events_seen", "events seen (training events × epochs)", "events"),
                              ("seconds", "training wall time (s, validation not counted)", "time")):
        fig, axes = plt.subplots(1, len(keys), figsize=(7 * len(keys), 5), squeeze=False)
        for ax, key in zip(axes[0], keys):
            for name, c in curves.items():
                pts = [p for p in c if p.get(key) is not None]
                style = ":" if name.startswith("np1-") else ("--" if "naive" in name else "-")
                ax.plot([p[x] for p in pts], [p[key] for p in pts], style, marker="o", label=name)
            if thresholds.get(key) is not None:
                ax.axhline(thresholds[key], color="0.5", lw=1,
                           label=f"threshold {thresholds[key]:.3g} (worst np=1 final)")
            floor = 0.5 if key == "auc_high" else 1.0
            ax.axhline(floor, color="k", lw=0.8, ls="-.", label=f"MC-vs-MC floor ({floor:g})")
            ax.set(xlabel=xlabel, ylabel=LABELS[key], yscale="linear" if key == "auc_high"
                   else "log", title=f"3DGAN {LABELS[key].split(' (')[0]} against {suffix}")
            ax.legend(fontsize=9, loc="best")  # off the curves
        fig.tight_layout()
        path = f"{out}_{suffix}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def fmt(v, spec=".3g", none="n/a") -> str:
    return none if v is None else format(v, spec)


def reached(seconds) -> str:
    """A time to a threshold, or that the run never got there."""
    return "not reached" if seconds is None else format(seconds, ".1f")


def markdown(s: dict, args, p: dict) -> list:
    f = fmt

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
                     f"{reached(ttq)} |")
    for name, message in s["collapsed"].items():
        lines.append(f"| {name} | {message} | | | | | |")
    t = s["thresholds"]
    if t.get("fpd_sigma") is not None or t.get("auc_high") is not None:
        lines += ["", f"The CaloChallenge metrics (thresholds, the worst final np=1 values: FPD "
                      f"σ {f(t['fpd_sigma'])}, AUC {f(t['auc_high'])}):", "",
                  "| run | final FPD (σ from its floor) | final high-level AUC | time to FPD threshold (s) | "
                  "time to AUC threshold (s) | CPU-minutes |", "|---|---|---|---|---|---|"]
        for name, r in s["rows"].items():
            cpu = r.get("cpu_seconds")
            lines.append(f"| {name} | {f(r['final_fpd_sigma'])} | {f(r['final_auc_high'])} | "
                         f"{reached(r['time_to_fpd_sigma'])} | {reached(r['time_to_auc_high'])} | "
                         f"{f(cpu / 60 if cpu else None, '.1f')} |")
    lines += ["", f"np=1 final score ratio: mean {s['np1_mean']:.3f}, range "
                  f"{s['np1_spread'][0]:.3f}-{s['np1_spread'][1]:.3f} (band ±{s['band']:.3f}: the "
                  f"spread or 10 % of the mean); np=4 ({args.rule}) within it: "
                  f"{s['np4_within_np1_spread']}; time-to-quality np=2 / np=1 (mean "
                  f"{s['np1_time_to_quality']:.1f} s): {f(s['ttq_ratio_np2_over_np1'])}"]
    return lines


def partial_markdown(curves: dict, cpu: dict, collapsed: dict) -> list:
    """Per epoch of each run so far: what the table will summarise."""
    def f(v, spec=".3g"):
        return fmt(v, spec, none="-")

    lines = []
    for name, c in curves.items():
        lines += [f"{name} ({f(cpu.get(name, 0) / 60, '.1f')} CPU-minutes in all):", "",
                  "| epoch | events seen | train s | score ratio | FPD (σ from its floor) | AUC high | "
                  "sampling_fraction_mre |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {pt['epoch']} | {pt['events_seen']} | {pt['seconds']:.0f} | "
                  f"{f(pt['score_ratio'])} | {f(pt['fpd'])} ({f(pt.get('fpd_sigma'))}) | "
                  f"{f(pt['auc_high'])} | {f(pt['sampling_fraction_mre'])} |" for pt in c]
        lines.append("")
    lines += [f"{name}: {message}" for name, message in collapsed.items()]
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (<= 3 min on 2 cores)")
    ap.add_argument("--preset", choices=("small", "full", "smooth"), default=None,
                    help="full: the full 3DGAN at GPU sizes; smooth: issue 49's CPU preset with "
                    "the CaloChallenge metrics (default: small, CPU sizes)")
    ap.add_argument("--only", type=lambda v: v.split(","), default=None, metavar="NAME,...",
                    help="run only these runs (np2-linear, np1-seed0, ...), no table")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run (repeatable)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--rule", default=None, choices=("best",) + RULES,
                    help="the large-batch rule of the np=2 run (default: the best at np=4)")
    ap.add_argument("--warmup", type=float, default=1.0, help="warm-up epochs of the rule")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="CPU threads shared by a run's ranks")
    ap.add_argument("--out", default=None, help="results prefix (default bench/results/convergence"
                    "[_quick]); runs and data in OUT/")
    args = ap.parse_args()
    p = dict(PRESETS["quick" if args.quick else
                     (args.preset if args.preset in ("full", "smooth") else "cpu")])
    args.rule = args.rule or p.get("rule", "best")
    out = args.out or os.path.join(RESULTS, "convergence" + (
        "_quick" if args.quick else "_smooth" if args.preset == "smooth" else ""))
    os.makedirs(out, exist_ok=True)
    files, val = simulate_data(os.path.join(out, "runs", "data"), p)  # runs/: git-ignored
    curves, collapsed = {}, {}

    def run(name, ranks, seed, rule, warmup):
        if args.only and name not in args.only:
            return
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
    for spec in np4_runs(rules, args.warmup, p.get("naive", True)):
        run(*spec)
    args.rule = best_rule(curves, rules) if len(rules) > 1 else rules[0]
    print(f"the best rule at np=4: {args.rule}", flush=True)
    run(f"np2-{args.rule}", 2, 0, args.rule, args.warmup)
    cpu = {name: float(open(os.path.join(out, "runs", name, CPU_FILE)).read())
           for name in curves if os.path.exists(os.path.join(out, "runs", name, CPU_FILE))}
    if args.only:  # some runs only (a session's share of a long bench): their curves, no table
        write(f"{out}_partial", {"config": {**p, **vars(args)}, "curves": curves, "cpu": cpu,
                                 "collapsed": collapsed,
                                 "plots": plot(curves, {}, f"{out}_partial")},
              partial_markdown(curves, cpu, collapsed))
        return
    s = summarise(curves, collapsed, args.rule, cpu)
    plots = plot(curves, s["thresholds"], out)
    write(out, {"config": {**p, **vars(args)}, "curves": curves, "summary": s, "plots": plots},
          markdown(s, args, p))


if __name__ == "__main__":
    main()
