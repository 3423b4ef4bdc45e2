"""HPO at supercomputer scale, by simulation: 8 to 1 024 workers, 10 evaluations each.

    python bench/hpo_scale.py --quick       # 8 and 64 workers, 1 seed, 2 sweeps at once: < 3 min
    python bench/hpo_scale.py               # 8, 64, 256, 1 024 workers, 5 seeds (hours;
                                            # --jobs 4 runs 4 sweeps at once on a quiet node)
    python bench/hpo_scale.py --workers 1024 --seeds 5 --jobs 4   # one size
    python bench/hpo_scale.py --workers 1024 --searchers gp --fail-fraction 0 0.01 \
        --out bench/results/hpo_scale_failures   # the failure row beside its baseline

Every sweep is ``mpirun -np 2``: rank 0 runs the real coordinator (journal with group
commits, prefetcher, searcher), rank 1 plays the workers with the messages real blocks send
(``mpilearn.hpo.simulate``: why that is faithful is in its docstring). A trial lasts a
log-normal time (sigma 0.5; median ``max(1 s, workers / 100 s)``, so the coordinator sees
about 100 requests a second at every size) and returns Hartmann-6 plus Gaussian noise (sd 0.1),
or with ``--problem ackley10`` Ackley in 10 dimensions on [-5, 10]^10 (sd 0.1), or with
``--problem gan3d_like`` the 3DGAN sweep's shape (``benchmarks.gan3d_like``: lr, two widths,
four loss weights; minimum 1.0, sd 0.2; about 8 % of random points diverge and fail).

Searchers: random, evolution (DEAP), gp (scikit-optimize's GP; past 16 busy points, batches
from one model with per-point exploration weights: the scalable path), forest (extra trees on
every result, a UCB weight and half the trees drawn per suggestion, refits in their own
thread: ``searchers.ForestSearcher``), and Optuna's TPE
(``TPESampler(constant_liar=True)`` through its documented ask/tell, driven by the same
coordinator and prefetcher as ours), and DeepHyper's centralised BO (``deephyper.hpo.CBO``:
extra trees, UCB, ``qUCBd`` batches, through its ask/tell; a bench extra,
``bench/requirements-peers.txt``). gp, forest, TPE and DeepHyper start with one random point
per worker (the first wave has no data to model).

Reported per worker count and searcher (mean over seeds; regret: median over seeds):
- utilisation: trial time / each worker's time in the sweep (from the start until it is
  told that no trial is left), over all workers; beside it the least busy worker's, among
  those that did not vanish;
- model share: the share of the post-initial suggestions that came from the model;
- regret (noise-free value of the best point found, minus the minimum) after all
  evaluations, and curves against evaluations and wall time (OUT.png);
- the coordinator's decision latency (a block's request received -> its next trial sent,
  including the journal's fsync; a release, "no trial left", counts with the release waits)
  for the requests it answered at once, and apart from them
  the share of requests that queued for a model point still being computed (the coordinator
  serves the others meanwhile) with their wait; its CPU time per decision (the main thread's).
- with ``--fail-fraction F``: that share of the blocks fails once mid-trial, half vanishing,
  half hanging for the watchdog's time (``mpilearn.hpo.simulate``); utilisation is then that
  of the surviving capacity (a vanished block's time ends at its failure; the lost part of a
  trial counts as idle), beside the trials interrupted and lost (budget - distinct trials done).
- idle: where the rest of the capacity went, as shares of it (``idle_shares``): waiting for
  a model point (queued), for an answer given at once (dispatch), for a release (the spare
  held back after the budget is handed out, the sweep's end), the lost part of failed
  trials, the hangs until the watchdog's reset. Time is real (wall-clock): a loaded machine
  shows up as model and dispatch waits, so compare rows run on the same quiet machine.
Writes bench/results/hpo_scale.{json,md,png}.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from mpilearn.hpo.searchers import Searcher  # noqa: E402
from mpilearn.hpo.simulate import PROBLEMS  # noqa: E402
from mpilearn.hpo.space import trial_key  # noqa: E402

SEARCHERS = ("random", "evolution", "gp", "forest", "optuna-tpe", "deephyper-cbo")


class OptunaTPE(Searcher):
    """Optuna's TPE through ``study.ask``/``study.tell`` with constant liar (trials still
    running count as bad ones), so that the coordinator drives it as it drives ours."""

    def __init__(self, space, seed, n_startup):
        super().__init__(space, seed)
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.optuna = optuna
        self.n_startup = n_startup
        self.study = optuna.create_study(sampler=optuna.samplers.TPESampler(
            seed=seed, constant_liar=True, n_startup_trials=n_startup))
        self.dists = {p.name: optuna.distributions.FloatDistribution(p.low, p.high)
                      for p in space.params}
        self.open = {}  # key -> optuna trial asked, not told
        self.told = 0

    def ask_many(self, n, pending=(), exclude=()):
        out = []
        for _ in range(n):
            trial = self.study.ask(self.dists)
            point = dict(trial.params)
            if trial_key(point) in exclude:
                self.study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
                continue
            self.open[trial_key(point)] = trial
            out.append((point, "model" if self.told >= self.n_startup else "initial"))
        return out

    def tell_many(self, results):
        for point, loss in results:
            trial = self.open.pop(trial_key(point), None)
            self.told += loss is not None
            if trial is not None:
                if loss is None:
                    self.study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
                else:
                    self.study.tell(trial, float(loss))
            elif loss is not None:  # a fallback point the coordinator handed out
                self.study.add_trial(self.optuna.trial.create_trial(
                    params=point, distributions=self.dists, value=float(loss)))


class DeepHyperCBO(Searcher):
    """DeepHyper's centralised Bayesian optimisation (``deephyper.hpo.CBO``, 0.13.2: an
    extra-trees surrogate, UCB with its decaying kappa) through its documented ``ask``/``tell``,
    driven by the same coordinator and prefetcher as ours; a batch by its ``qUCBd`` strategy
    (one fit, a kappa drawn per point: what its docs recommend over constant liar's refits for
    large batches). DeepHyper maximises: it is told minus the loss; a failed trial is "F".
    A bench extra: ``pip install -r bench/requirements-peers.txt``."""

    def __init__(self, space, seed, n_initial, log_dir, **cbo_options):
        super().__init__(space, seed)
        import logging

        from deephyper.hpo import CBO, HpProblem

        logging.getLogger("deephyper").setLevel(logging.WARNING)
        problem = HpProblem()
        for p in space.params:  # ints as ints, log axes log-uniform, as its docs declare them
            kind = int if p.type == "int" else float
            bounds = (kind(p.low), kind(p.high)) + (("log-uniform",) if p.log else ())
            problem.add_hyperparameter(bounds, p.name)
        options = dict(surrogate_model="ET", acq_func="UCBd", multi_point_strategy="qUCBd")
        options.update(cbo_options)  # e.g. multi_point_strategy "cl_max", CBO's own default
        self.search = CBO(problem, random_state=seed, log_dir=log_dir,
                          checkpoint_history_to_csv=False, n_initial_points=n_initial, **options)
        # its optimiser (built at the first ask) keeps every model it fits unless given a queue
        # size, which CBO does not pass, and asks from the newest only: 16 searches' old
        # forests filled 20 GB here in one 1 024-worker sweep
        self.search._opt_kwargs["model_queue_size"] = 1
        self.n_initial, self.handed = n_initial, 0

    def ask_many(self, n, pending=(), exclude=()):
        out = []
        for config in self.search.ask(n):
            point = {p.name: (int if p.type == "int" else float)(config[p.name])
                     for p in self.space.params}
            if trial_key(point) in exclude:
                continue
            out.append((point, "initial" if self.handed < self.n_initial else "model"))
            self.handed += 1
        return out

    def tell_many(self, results):
        if results:
            self.search.tell([(dict(point), "F" if loss is None else -float(loss))
                              for point, loss in results])


def one(argv) -> int:
    """Under mpirun: one sweep (``mpilearn.hpo.simulate``), with Optuna's TPE if asked."""
    from mpilearn.hpo import simulate

    args, _ = simulate.parser().parse_known_args(argv)
    factory = None
    if args.searcher == "optuna-tpe":
        factory = lambda space, seed: OptunaTPE(space, seed, args.workers)  # noqa: E731
    elif args.searcher == "deephyper-cbo":
        factory = lambda space, seed: DeepHyperCBO(  # noqa: E731
            space, seed, args.workers, os.path.join(args.out, "deephyper"))
    return simulate.main(argv, factory)


def sweep(searcher, workers, seed, median_s, tmp, fail=0.0, problem="hartmann6"):
    out = os.path.join(tmp, f"{searcher}-{workers}-{seed}-{fail:g}-{problem}")
    options = {"n_initial": workers} if searcher in ("gp", "forest") else {}
    cmd = ["mpirun", "-np", "2", "--oversubscribe", sys.executable, os.path.abspath(__file__),
           "--one", "--workers", str(workers), "--searcher", searcher, "--seed", str(seed),
           "--median-s", str(median_s), "--out", out, "--options", json.dumps(options),
           "--fail-fraction", str(fail), "--problem", problem]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return metrics(out, problem)


def vanished(sim):
    """The blocks whose ranks were lost for good (their capacity ended at the failure)."""
    return [block for block, kind, _ in sim.get("lost", []) if kind == "vanish"]


def metrics(out, problem="hartmann6"):
    sim = json.load(open(os.path.join(out, "sim.json")))
    journal = [json.loads(line) for line in open(os.path.join(out, "journal.jsonl"))]
    origins = Counter(e.get("origin") for e in journal if e["event"] == "started")
    post = sum(origins.values()) - origins["initial"] - origins["enqueued"]
    trials = sorted(sim["trials"], key=lambda t: t[1])  # by end time
    regret = np.minimum.accumulate([np.inf if t[2] is None else t[2] for t in trials]) \
        - PROBLEMS[problem][1]  # a failed trial (None) has no value
    busy, window = np.array(sim["busy_s"]), np.array(sim["window_s"])
    # the least busy worker counts the survivors only: a block lost in its first trial did no
    # busy time at all, and its 0 % would only say that it failed
    alive = (window > 0) & ~np.isin(np.arange(len(window)), vanished(sim))
    lat, cpu = np.array(sim["latency_s"]), np.array(sim["decision_cpu_s"])
    queued = np.array(sim["queued"], dtype=bool)
    at_once, waited = lat[~queued], lat[queued]
    ended = {e["key"] for e in journal if e["event"] in ("done", "failed")}
    budget = len(sim["busy_s"]) * sim["evals_per_worker"]
    return {"utilisation": float(busy.sum() / window.sum()), **idle_shares(sim, window.sum()),
            "failed_blocks": len(sim.get("lost", [])),
            "interrupted": sum(e["event"] == "interrupted" for e in journal),
            "lost_trials": budget - len(ended), "exact_budget": len(trials) == budget,
            "utilisation_min": float(np.min(busy[alive] / window[alive])),
            "model_share": origins["model"] / post if post and origins["model"] else None,
            "origins": dict(origins), "trials": len(trials),
            "once": len(ended) == len(trials),
            "failed_trials": sum(e["event"] == "failed" for e in journal),
            "regret": float(regret[-1]), "regret_curve": regret.tolist(),
            "end_s": [t[1] for t in trials], "wall_s": sim["wall_s"],
            "decision_p50_ms": 1e3 * float(np.percentile(at_once, 50)),
            "decision_p95_ms": 1e3 * float(np.percentile(at_once, 95)),
            "all_requests_p95_ms": 1e3 * float(np.percentile(lat, 95)),
            "queued_share": float(queued.mean()),
            "queued_p95_ms": 1e3 * float(np.percentile(waited, 95)) if waited.size else 0.0,
            "cpu_per_decision_p50_ms": 1e3 * float(np.percentile(cpu, 50)),
            "cpu_per_decision_p95_ms": 1e3 * float(np.percentile(cpu, 95)),
            "block_wait_p95_ms": 1e3 * float(np.percentile(sim["wait_s"], 95)),
            "coordinator_process_cpu_s": sim["process_cpu_s"]}


def idle_shares(sim, capacity):
    """Where the idle part of the capacity went, each as a share of it (they add up to
    1 - utilisation, less ``idle_rest``): blocks waiting for a model point being computed (the
    coordinator's queued answers), for an answer given at once (decision, group commit,
    messages, the simulator's lag), for a release (a spare held back, the sweep's end), the
    lost part of failed trials, and the hangs until the watchdog's reset."""
    parts = sim.get("idle_parts_s", {})
    lat = np.array(sim["latency_s"])
    model = float(lat[np.array(sim["queued"], dtype=bool)].sum()) if lat.size else 0.0
    out = {"idle_model_wait": model, "idle_dispatch": parts.get("trial_wait_s", 0.0) - model,
           "idle_release_wait": parts.get("release_wait_s", 0.0),
           "idle_lost_work": parts.get("lost_work_s", 0.0), "idle_hang": parts.get("hang_s", 0.0)}
    out = {k: v / capacity for k, v in out.items()}
    busy = float(np.sum(sim["busy_s"]))
    out["idle_rest"] = 1 - busy / capacity - sum(out.values())
    return out


IDLE = (("idle_model_wait", "model"), ("idle_dispatch", "dispatch"),
        ("idle_release_wait", "release/spare"), ("idle_lost_work", "lost work"),
        ("idle_hang", "hang"))


def table(rows, sizes, searchers, seeds):
    problems = sorted({r.get("problem", "hartmann6") for r in rows})
    md = [", ".join(f"{p} + noise (sd {PROBLEMS[p][2]:g})" for p in problems)
          + f", 10 evaluations per worker, {len(seeds)} seed(s); "
          "regret: median over seeds after all evaluations (noise-free value of the best point "
          "found); the rest: mean over seeds. Decision: the coordinator's time from a "
          "block's request to its answer, with the journal's fsync, for the requests it "
          "answered at once; queued: the requests that waited for a model point being "
          "computed (their share, and their wait's p95); CPU: the coordinator's main thread's "
          "CPU per decision.", "",
          "| workers | trial median | searcher | failing blocks: interrupted, lost trials, "
          "exact budget | utilisation (min worker) | model share | regret | "
          "decision p50 / p95 (ms) | queued share, p95 (ms) | CPU per decision p50 / p95 (ms) | "
          "block wait p95 (ms) | wall (s) | idle: " + ", ".join(n for _, n in IDLE) + " |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fails = sorted({r.get("fail", 0.0) for r in rows})
    for w, s, fail in [(w, s, f) for w in sizes for s in searchers for f in fails]:
        runs = [r for r in rows if r["workers"] == w and r["searcher"] == s
                and r.get("fail", 0.0) == fail]
        if not runs:
            continue
        mean = lambda k: float(np.mean([r[k] for r in runs]))  # noqa: E731
        shares = [r["model_share"] for r in runs if r["model_share"] is not None]
        md.append(
            f"| {w} | {runs[0]['median_s']:g} s | {s} | "
            f"{fail:.0%} ({mean('failed_blocks'):.0f}): {mean('interrupted'):.1f}, "
            f"{sum(r['lost_trials'] for r in runs)}, "
            f"{'yes' if all(r['exact_budget'] for r in runs) else 'NO'} | "
            f"{mean('utilisation'):.2%} "
            f"({min(r['utilisation_min'] for r in runs):.1%}) | "
            f"{f'{np.mean(shares):.1%}' if shares else 'n/a'} | "
            f"{np.median([r['regret'] for r in runs]):.4f} | "
            f"{mean('decision_p50_ms'):.1f} / {mean('decision_p95_ms'):.1f} | "
            f"{mean('queued_share'):.1%}, {mean('queued_p95_ms'):.0f} | "
            f"{mean('cpu_per_decision_p50_ms'):.2f} / {mean('cpu_per_decision_p95_ms'):.2f} | "
            f"{mean('block_wait_p95_ms'):.0f} | {mean('wall_s'):.0f} | "
            + ", ".join(f"{mean(k):.2%}" for k, _ in IDLE) + " |")
    return md


def plot(rows, sizes, searchers, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(sizes), figsize=(4.5 * len(sizes), 7), squeeze=False)
    for col, w in enumerate(sizes):
        for s in searchers:
            runs = [r for r in rows if r["workers"] == w and r["searcher"] == s]
            if not runs:
                continue
            n = min(len(r["regret_curve"]) for r in runs)
            curve = np.median([r["regret_curve"][:n] for r in runs], axis=0)
            end = np.median([r["end_s"][:n] for r in runs], axis=0)
            axes[0, col].plot(np.arange(1, n + 1), curve, label=s)
            axes[1, col].plot(end, curve, label=s)
        axes[0, col].set(yscale="log", title=f"{w} workers", xlabel="evaluations",
                         ylabel="median regret")
        axes[1, col].set(yscale="log", xlabel="wall time (s)", ylabel="median regret")
        axes[0, col].legend(fontsize=7)
        for ax in axes[:, col]:  # 160 000 evaluations' labels overlapped in a 4.5-inch panel
            ax.locator_params(axis="x", nbins=4)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main():
    if "--one" in sys.argv:
        sys.exit(one([a for a in sys.argv[1:] if a != "--one"]))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import write

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 and 64 workers, 1 seed")
    ap.add_argument("--workers", type=int, nargs="+", help="worker counts (default 8 64 256 1024)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--searchers", nargs="+", default=list(SEARCHERS), choices=SEARCHERS)
    ap.add_argument("--median-s", type=float, help="median trial length (default max(1, W/100))")
    ap.add_argument("--jobs", type=int, help="sweeps run at once (default 1; --quick: 2)")
    ap.add_argument("--fail-fraction", type=float, nargs="+", default=[0.0],
                    help="shares of the blocks that fail mid-sweep, one row each (0 0.01)")
    ap.add_argument("--problem", default="hartmann6", choices=sorted(PROBLEMS),
                    help="the function every sweep minimises (mpilearn.hpo.simulate)")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "hpo_scale"))
    a = ap.parse_args()
    sizes = a.workers or ([8, 64] if a.quick else [8, 64, 256, 1024])
    seeds = range(1 if a.quick else a.seeds)
    plan = [(s, w, seed, a.median_s or max(1.0, w / 100), f) for w in sizes for seed in seeds
            for s in a.searchers for f in a.fail_fraction]
    rows = []
    with tempfile.TemporaryDirectory(dir=os.path.join(REPO, "bench", "results")) as tmp:
        def go(job):
            s, w, seed, median_s, fail = job
            start = time.perf_counter()
            row = {"searcher": s, "workers": w, "seed": seed, "median_s": median_s, "fail": fail,
                   "problem": a.problem, **sweep(s, w, seed, median_s, tmp, fail, a.problem)}
            print(json.dumps({k: v for k, v in row.items() if k not in ("regret_curve", "end_s")})
                  + f"  ({time.perf_counter() - start:.0f} s)", flush=True)
            return row

        with ThreadPoolExecutor(a.jobs or (2 if a.quick else 1)) as pool:
            rows = list(pool.map(go, plan))
    md = table(rows, sizes, a.searchers, seeds)
    md += ["", f"Command: `python bench/hpo_scale.py {' '.join(sys.argv[1:])}`; curves: "
           f"{os.path.basename(a.out)}.png"]
    plot(rows, sizes, a.searchers, a.out + ".png")
    write(a.out, [thin(r) for r in rows], md)


def thin(row, most=2048):
    """The row with its per-trial curves kept at every k-th trial (``curve_stride``), so that
    a 16 384-worker sweep's JSON stays small; the plot above drew them whole."""
    k = max(1, -(-len(row["regret_curve"]) // most))
    return {**row, "curve_stride": k, "regret_curve": row["regret_curve"][::k],
            "end_s": row["end_s"][::k]}


if __name__ == "__main__":
    main()
