"""Does np=4 train the same 3DGAN as np=1 at equal events? Each lr rule over a seed band, with
the gradient noise scale of G and D over every run.

The smooth preset's protocol of bench/convergence.py (2 048 training events x 10 epochs, 16
events per rank, the sweep's lr 2.36e-3, FPD and the high-level classifier AUC every epoch or
second epoch on held-out MC), so every run sees the same events; only how they are split over
ranks, the lr rule and the seed change:

    np1-seed0..4          one rank, the band (seeds 0-2 may come from --prior)
    np4-auto-seed0..2     the default rule (RMSprop: sqrt), warm-up 1 epoch
    np4-gain-seed0..2     AdaScale's gain ratio from the measured noise scale
    np4-none-seed0..1     the configured lr unchanged
    np4-srsr-seed0..1     Malladi's square-root rule in full (lr, 1-beta, eps)
    np2-auto-seed0..1     the default rule at np=2
    np4-b4                the control: 4 events per rank, the same global batch as np=1

Targets: with the default rule np=4's median final FPD within the np=1 band (<= its top), no np=4
seed above 1.5x np=1's median, np=2 both too; np=2 reaches the band's worst final FPD in <= 0.6x
np=1's training time. Resumable and shareable across sessions: each run is a run directory
under OUT/runs; ``--only NAME,...`` runs a share; the table is written from whatever runs are
finished (a run still missing is listed as such). ``--prior JSON`` takes finished runs' curves
from earlier tables (bench/results/convergence_smooth.json holds np1-seed0..2; the committed
scale_rules.json holds every run finished so far, so a session goes on from there).

    python bench/scale_rules.py --only np4-auto-seed0,np1-seed3 --out /work/runs/scale_rules
    python bench/scale_rules.py --out /work/runs/scale_rules   # every run (~17 CPU-hours)

Writes OUT.json / OUT.md, OUT_fpd.png (FPD against events seen) and OUT_noise.png (G's and D's
critical batch against epochs); OUT defaults to bench/results/scale_rules.
"""
import argparse
import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import convergence as conv  # noqa: E402
from common import RESULTS, write  # noqa: E402
from mpilearn.allreduce.noise import useful_ranks  # noqa: E402

LR = "hparams.lr=0.00236"  # the sweep's choice for the smooth preset (bench/RESULTS.md)
BASE = 16                   # events per rank at np=1, and the base batch of every rule


def plan() -> list:
    """(name, ranks, seed, rule, warm-up epochs, events per rank) in the order they run."""
    runs = [(f"np1-seed{s}", 1, s, "none", 0.0, BASE) for s in range(5)]
    runs += [(f"np4-auto-seed{s}", 4, s, "auto", 1.0, BASE) for s in range(3)]
    runs += [(f"np2-auto-seed{s}", 2, s, "auto", 1.0, BASE) for s in range(2)]
    runs += [(f"np4-gain-seed{s}", 4, s, "gain", 1.0, BASE) for s in range(3)]
    runs += [(f"np4-none-seed{s}", 4, s, "none", 0.0, BASE) for s in range(2)]
    runs += [(f"np4-srsr-seed{s}", 4, s, "srsr", 1.0, BASE) for s in range(2)]
    runs += [("np4-b4", 4, 0, "auto", 0.0, 4)]
    return runs


def curve(records: list, events: int) -> list:
    """convergence.curve's points, each with G's and D's noise-scale estimate of the epoch."""
    points = conv.curve(records, events)
    for pt, r in zip(points, records):
        pt["noise_scale"] = r.get("noise_scale")
    return points


def run_one(spec, p, files, val, args, out):
    name, ranks, seed, rule, warmup, batch = spec
    run_args = argparse.Namespace(**vars(args))
    run_args.set = [LR, f"train.base_batch={BASE}"] + args.set
    got = conv.train(name, ranks, seed, rule, warmup, dict(p, batch=batch), files, val,
                     run_args, out)
    return got if isinstance(got, str) else curve(got, p["events"])


def group(name: str) -> str:
    return name.rsplit("-seed", 1)[0]


def fpd_final(c):
    return conv.final(c, "fpd")


def time_to_fpd(c, threshold):
    return conv.time_to(c, threshold, "fpd")


def noise_last(c) -> dict:
    """{optimizer: (critical batch, its error)} at the run's last epoch that measured it."""
    for pt in reversed(c):
        if pt.get("noise_scale"):
            return {k: (v.get("critical_batch"), v.get("critical_batch_err"))
                    for k, v in pt["noise_scale"].items()}
    return {}


def summarise(curves: dict, specs: dict) -> dict:
    np1 = [fpd_final(c) for n, c in curves.items() if n.startswith("np1-")]
    if not np1:
        return {"rows": {}, "np1": None}
    median1, top1 = statistics.median(np1), max(np1)
    rows = {}
    for name, c in curves.items():
        spec = specs.get(name)
        per_rank = spec[5] if spec else BASE
        noise = noise_last(c)
        rows[name] = {"final_fpd": fpd_final(c),
                      "best_fpd": min((pt["fpd"] for pt in c if pt.get("fpd") is not None), default=None),
                      "final_auc_high": conv.final(c, "auc_high"),
                      "seconds": c[-1]["seconds"], "time_to_band": time_to_fpd(c, top1),
                      "noise": noise,
                      "useful_ranks": {k: useful_ranks(crit, per_rank, err)
                                       for k, (crit, err) in noise.items()}}
    groups = {}
    for name, r in rows.items():
        groups.setdefault(group(name), []).append(r["final_fpd"])
    np1_ttq = [r["time_to_band"] for n, r in rows.items() if n.startswith("np1-")
               and r["time_to_band"] is not None]
    verdicts = {}
    # the targets are the default's (auto); the other rules get the same yardstick beside them
    for g in ["np4-auto", "np2-auto"] + sorted(set(groups) - {"np4-auto", "np2-auto", "np1"}):
        finals = groups.get(g)
        if finals:
            verdicts[g] = {"median_final_fpd": statistics.median(finals), "seeds": len(finals),
                           "median_within_band": statistics.median(finals) <= top1,
                           "no_seed_above_1.5x_median": max(finals) <= 1.5 * median1}
    # a run that never reaches the band takes forever: its median decides without a clock,
    # so that verdict holds even where the seconds were measured on a shared machine
    np2_ttq = [rows[n]["time_to_band"] for n in rows if group(n) == "np2-auto"]
    ttq, never = None, False
    if np2_ttq and np1_ttq:
        median2 = statistics.median(math.inf if t is None else t for t in np2_ttq)
        never = math.isinf(median2)
        ttq = None if never else median2 / statistics.median(np1_ttq)
    return {"np1": {"finals": np1, "median": median1, "top": top1, "bottom": min(np1)},
            "rows": rows, "groups": {g: {"finals": f, "median": statistics.median(f)}
                                     for g, f in groups.items()},
            "verdicts": verdicts, "time_to_band_np2_over_np1": ttq,
            "np2_median_never_reached_band": never,
            "np2_runs_never_reached_band": sum(t is None for t in np2_ttq), "np2_runs": len(np2_ttq)}


def markdown(s: dict, missing: list, collapsed: dict, cpu: dict, p: dict,
             concurrent: int = 1, where: str = "", cpu_partial=()) -> list:
    f = conv.fmt
    if s["np1"] is None:
        return ["No np=1 run has finished yet: no band, no table."]
    b = s["np1"]
    lines = [f"The 3DGAN smooth preset at equal events ({p['events']} training events x "
             f"{p['epochs']} epochs; 16 events per rank unless named; lr 2.36e-3 at base batch "
             f"{BASE}). The np=1 band over {len(b['finals'])} seeds: final FPD "
             f"{b['bottom']:.3g}-{b['top']:.3g}, median {b['median']:.3g}."
             + (f" Device: {where}." if where else "")
             + (f" Up to {concurrent} runs shared the machine at once: the seconds and the time "
                "ratio are not timings." if concurrent > 1 else ""), "",
             "| run | final FPD | best FPD | final AUC (high-level) | time to the band's top (s) | "
             "CPU-minutes | critical batch D | critical batch G | useful ranks D / G |",
             "|---|---|---|---|---|---|---|---|---|"]
    uncertain = False
    for name, r in s["rows"].items():
        crit = {k: (f"{v[0]:.3g} ± {f(v[1], '.2g')}" if v[0] else "beyond measure")
                for k, v in r["noise"].items()}
        # a measured critical batch without a count: its error is as large as it
        useful = {k: ("?" if v is None and r["noise"][k][0] else f(v, "d", "-"))
                  for k, v in r["useful_ranks"].items()}
        uncertain = uncertain or "?" in useful.values()
        lines.append(f"| {name} | {f(r['final_fpd'])} | {f(r['best_fpd'])} | "
                     f"{f(r['final_auc_high'])} | {conv.reached(r['time_to_band'])} | "
                     f"{'≥ ' if name in cpu_partial else ''}"
                     f"{f(cpu.get(name, 0) / 60 if cpu.get(name) else None, '.1f')} | "
                     f"{crit.get('discriminator', '-')} | {crit.get('generator', '-')} | "
                     f"{useful.get('discriminator', '-')} / {useful.get('generator', '-')} |")
    lines += [f"| {name} | {message} | | | | | | | |" for name, message in collapsed.items()]
    if uncertain:
        lines += ["", "?: the critical batch's error is as large as it, so no rank count is "
                  "read off it (the run's end line says so too)."]
    lines += ["", "The targets are the default rule's (np4-auto, np2-auto); the other rows are "
              "measured with the same yardstick.",
              "", "| rule, ranks | seeds | median final FPD | median within the np=1 band | "
              "no seed above 1.5x np=1's median |", "|---|---|---|---|---|"]
    for g, v in s["verdicts"].items():
        lines.append(f"| {g} | {v['seeds']} | {v['median_final_fpd']:.3g} | "
                     f"{'met' if v['median_within_band'] else 'missed'} | "
                     f"{'met' if v['no_seed_above_1.5x_median'] else 'missed'} |")
    ratio = s["time_to_band_np2_over_np1"]
    if s.get("np2_median_never_reached_band"):
        shown, verdict = "never", (f"missed: {s['np2_runs_never_reached_band']} of "
                                   f"{s['np2_runs']} np=2 runs never reached it, so their "
                                   "median does not")
    elif ratio is not None and concurrent == 1:
        shown, verdict = f(ratio), ("met" if ratio <= 0.6 else "missed")
    else:
        shown, verdict = f(None), "not measured"
    lines += ["", f"Time to the band's top FPD, np=2 over np=1 (medians): {shown} (target <= "
              f"0.6: {verdict})"]
    if cpu_partial:
        lines += ["", "≥: a launch of the run was killed before it ended (a resumed run); its "
                  "CPU-seconds were not counted."]
    if missing:
        lines += ["", "Not yet run: " + ", ".join(missing)]
    return lines


def plot(curves: dict, out: str) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {}
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, c in curves.items():
        g = group(name)
        colour = colours.setdefault(g, f"C{len(colours)}")
        pts = [pt for pt in c if pt.get("fpd") is not None]
        ax.plot([pt["events_seen"] for pt in pts], [pt["fpd"] for pt in pts],
                ":" if g.startswith("np1") else "-", color=colour, marker="o", ms=3,
                label=g if g not in [ln.get_label() for ln in ax.lines] else None)
    ax.set(xlabel="events seen (training events x epochs)", ylabel="FPD (lower is better)",
           yscale="log", title="3DGAN smooth preset: FPD at equal events, by rule and ranks")
    ax.legend(fontsize=9)
    fig.tight_layout()
    paths = [f"{out}_fpd.png"]
    fig.savefig(paths[0], dpi=80)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), squeeze=False)
    for ax, opt in zip(axes[0], ("discriminator", "generator")):
        for name, c in curves.items():
            pts = [(pt["epoch"], pt["noise_scale"][opt]) for pt in c
                   if (pt.get("noise_scale") or {}).get(opt, {}).get("critical_batch")]
            if pts:
                ax.errorbar([e for e, _ in pts], [v["critical_batch"] for _, v in pts],
                            yerr=[v.get("critical_batch_err") or 0 for _, v in pts],
                            marker="o", ms=3, capsize=2, label=name,
                            color=colours.get(group(name)))
        ax.axhline(BASE, color="0.5", lw=1, ls="--", label=f"{BASE} (one rank's batch)")
        ax.set(xlabel="epoch", ylabel="critical batch (events, preconditioned)", yscale="log",
               title=f"{opt}: gradient noise scale")
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(f"{out}_noise.png")
    fig.savefig(paths[1], dpi=80)
    plt.close(fig)
    return paths


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", type=lambda v: v.split(","), default=None, metavar="NAME,...",
                    help="run only these runs; 'none': run nothing, write the table (and the "
                    "data) from the runs already finished")
    ap.add_argument("--prior", action="append", default=None, metavar="JSON",
                    help="earlier tables whose finished runs count (same protocol; default: "
                    "bench/results/convergence_smooth.json and scale_rules.json, so a new "
                    "session goes on from the runs the last one committed; 'none': no earlier "
                    "table, as on another device)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", default=os.path.join(RESULTS, "scale_rules"))
    ap.add_argument("--concurrent", type=int, default=1, metavar="N",
                    help="runs that shared the machine at once (bench/gpu_session.sh's "
                    "scale_rules stage): the table then reads no timing from them")
    ap.add_argument("--where", default="", help="the device, for the table's first line")
    args = ap.parse_args()
    p = dict(conv.PRESETS["smooth"])
    os.makedirs(args.out, exist_ok=True)
    files, val = conv.simulate_data(os.path.join(args.out, "runs", "data"), p)
    prior, prior_cpu, cpu_partial = {"curves": {}}, {}, set()
    defaults = [os.path.join(RESULTS, f) for f in ("convergence_smooth.json", "scale_rules.json")]
    for path in [] if args.prior == ["none"] else args.prior or defaults:
        if os.path.exists(path):
            table = json.load(open(path))
            prior["curves"].update(table.get("curves", {}))
            prior_cpu.update({n: r.get("cpu_seconds") for n, r in
                              table.get("summary", {}).get("rows", {}).items()})
            prior_cpu.update(table.get("cpu", {}))
            cpu_partial.update(table.get("cpu_partial", []))
    specs = {spec[0]: spec for spec in plan()}
    curves, collapsed, missing, cpu = {}, {}, [], {}
    for name, spec in specs.items():
        folder = os.path.join(args.out, "runs", name)
        done = len(conv.epochs_of(folder)) >= p["epochs"]
        if not done and name in prior.get("curves", {}):
            curves[name], cpu[name] = prior["curves"][name], prior_cpu.get(name)
            continue
        if not done and args.only is not None and name not in args.only:
            missing.append(name)
            continue
        got = run_one(spec, p, files, val, args, args.out)
        if isinstance(got, str):
            collapsed[name] = got
        else:
            curves[name] = got
        cpu_file = os.path.join(folder, conv.CPU_FILE)
        if os.path.exists(cpu_file):
            cpu[name] = float(open(cpu_file).read())
        if conv.cpu_is_partial(folder):
            cpu_partial.add(name)
    s = summarise(curves, specs)
    if args.concurrent > 1 and s.get("time_to_band_np2_over_np1") is not None:
        s["time_to_band_np2_over_np1"] = None  # runs that shared the machine: no timing to read
    plots = plot(curves, args.out) if curves else []
    write(args.out, {"config": {**p, **vars(args)}, "curves": curves, "summary": s,
                     "missing": missing, "collapsed": collapsed, "cpu": cpu,
                     "cpu_partial": sorted(cpu_partial), "plots": plots},
          markdown(s, missing, collapsed, cpu, p, args.concurrent, args.where, cpu_partial))


if __name__ == "__main__":
    main()
