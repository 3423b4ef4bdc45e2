"""The search under parallel load, side by side with Optuna: quality, model share and cost.

    python bench/hpo_parallel.py [--quick] [--out bench/results/hpo_parallel]

1. Quality: Branin, Hartmann-6 and a noisy Branin; 5 seeds; 50 evaluations; 1 / 8 / 32 blocks;
   trials instant or about 1 s (0.5-1.5 s, seeded). Blocks are simulated in real time by one
   event loop: a block whose trial ends tells its result and asks for the next point.
   - mpilearn gp and random go through the coordinator's own Prefetcher and its wait rule
     (a block waits for a model point at most max(1 s, a quarter of a trial), then a fallback);
   - Optuna TPE (``TPESampler(seed)``: constant liar on by default in Optuna 5, the documented
     setting for parallel workers) and Optuna's GP sampler (``GPSampler(seed)``) are asked
     inline when a block frees, as Optuna workers sharing one study do.
   Reported: median regret after 50 evaluations (noise-free value for the noisy problem), and
   for mpilearn gp the share of post-initial suggestions that came from the model.
2. Cost at 1000 observations (6-D): a resume (journal replay, the searcher told 1000 finished
   trials in one batch, the first model suggestion), then one tell + ask with the kernel fixed,
   and one with the kernel's hyperparameters refitted (the 20 % schedule).
"""
import argparse
import heapq
import json
import os
import tempfile
import time

import numpy as np

from common import write
from mpilearn.hpo import benchmarks
from mpilearn.hpo.coordinator import Coordinator, model_wait
from mpilearn.hpo.journal import Journal
from mpilearn.hpo.prefetch import Prefetcher
from mpilearn.hpo.searchers import make_searcher
from mpilearn.hpo.space import Space, trial_key

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBLEMS = {"branin": (benchmarks.branin, benchmarks.BRANIN_MIN, "branin"),
            "hartmann6": (benchmarks.hartmann6, benchmarks.HARTMANN6_MIN, "hartmann6"),
            "noisy_branin": (benchmarks.noisy_branin, benchmarks.BRANIN_MIN, "branin")}
METHODS = ("mpilearn-gp", "mpilearn-random", "optuna-tpe", "optuna-gp")
N_INITIAL = 10  # ours and both Optuna samplers' n_startup_trials default


class Ours:
    def __init__(self, name, space, seed, blocks):
        options = {"n_initial": N_INITIAL} if name == "gp" else {}
        self.pool = Prefetcher(make_searcher(name, space, seed, **options),
                               ahead=-(-blocks // 4))
        self.walls = []

    def ask(self):
        point, origin = self.pool.get(model_wait(self.walls))
        return point, point, origin

    def tell(self, handle, value, wall):
        self.walls.append(wall)
        self.pool.tell(handle, value)

    def close(self):
        self.pool.close()


class OptunaPeer:
    def __init__(self, name, spec, seed):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.ERROR)
        sampler = (optuna.samplers.TPESampler(seed=seed) if name == "optuna-tpe"
                   else optuna.samplers.GPSampler(seed=seed))
        self.study = optuna.create_study(sampler=sampler)
        self.spec = spec

    def ask(self):
        trial = self.study.ask()
        return trial, {k: trial.suggest_float(k, v["low"], v["high"]) for k, v in self.spec.items()}, ""

    def tell(self, handle, value, wall):
        self.study.tell(handle, value)

    def close(self):
        pass


def sweep(method, problem, seed, blocks, trial_s, n=50):
    func, best, space_name = PROBLEMS[problem]
    spec = benchmarks.space(space_name)
    peer = (Ours(method.split("-")[1], Space.from_config(spec), seed, blocks)
            if method.startswith("mpilearn") else OptunaPeer(method, spec, seed))
    rng = np.random.default_rng([seed, blocks, int(trial_s * 10)])
    running, origins, found, dispatched = [], [], np.inf, 0
    start = time.perf_counter()

    def launch():
        nonlocal dispatched
        handle, point, origin = peer.ask()
        origins.append(origin)
        d = trial_s * rng.uniform(0.5, 1.5)
        heapq.heappush(running, (time.perf_counter() + d, dispatched, handle, point, d))
        dispatched += 1

    for _ in range(min(blocks, n)):
        launch()
    evaluated = 0
    while running:
        end, _, handle, point, d = heapq.heappop(running)
        time.sleep(max(0.0, end - time.perf_counter()))
        value = func(point)
        peer.tell(handle, value, d)
        evaluated += 1
        found = min(found, benchmarks.branin(point) if problem == "noisy_branin" else value)
        if dispatched < n:
            launch()
    peer.close()
    post = [o for o in origins[N_INITIAL:]]
    return {"regret": float(found - best), "wall_s": time.perf_counter() - start,
            "model_share": (sum(o == "model" for o in post) / len(post)) if post and origins[0] else None}


def cost_at_1000(n=1000):
    space_spec = benchmarks.space("hartmann6")
    space = Space.from_config(space_spec)
    rng = np.random.default_rng(0)
    points = [space.sample(rng) for _ in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        journal = Journal(os.path.join(tmp, "journal.jsonl"))
        for i, p in enumerate(points):
            key = trial_key(p)
            journal.write("started", key=key, trial=i, params=p, block=0,
                          origin="initial" if i < N_INITIAL else "model")
            journal.write("done", key=key, status="done", values=[benchmarks.hartmann6(p)],
                          value=benchmarks.hartmann6(p), wall=1.0, block=0, folds=[], params=p)
        config = {"search": {"budget": n + 10, "folds": 1, "fold_mode": "parallel",
                             "enqueue": []}}
        t = time.perf_counter()
        state = journal.replay()
        searcher = make_searcher("gp", space, 0, n_initial=N_INITIAL)
        coord = Coordinator(None, config, searcher, journal, state, blocks=8, progress=False)
        point, origin = coord.pool.get(wait=600)
        resume = time.perf_counter() - t
        coord.pool.close()
    assert origin == "model", origin
    out = {"resume_1000_s": resume}
    for label, extra in (("tell_ask_fixed_kernel_s", 1), ("tell_ask_hyper_refit_s", 200)):
        more = [space.sample(rng) for _ in range(extra)]
        searcher.tell_many([(p, benchmarks.hartmann6(p)) for p in more[:-1]])
        searcher.ask_many(1)  # absorb the batch, so only the last tell + ask is timed
        if label == "tell_ask_hyper_refit_s":
            searcher.n_hyper = int(len(searcher.y) / 1.2)  # due now
        t = time.perf_counter()
        searcher.tell(more[-1], benchmarks.hartmann6(more[-1]))
        searcher.ask_many(1)
        out[label] = time.perf_counter() - t
        out[label.replace("_s", "_observations")] = len(searcher.y)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "hpo_parallel"))
    ap.add_argument("--only", help="re-measure these settings (BLOCKS:TRIAL_S,...) and keep the "
                                   "other rows of OUT.json")
    a = ap.parse_args()
    seeds = range(2) if a.quick else range(5)
    settings = [(1, 0.0), (8, 0.0), (32, 0.0), (8, 1.0), (32, 1.0)]
    if not a.quick:
        settings.insert(1, (1, 0.2))  # 1 s trials on one block would take 50 s per run
    rows, cost = [], None
    if a.only:
        wanted = {(int(b), float(t)) for b, t in (x.split(":") for x in a.only.split(","))}
        old = json.load(open(a.out + ".json"))
        rows = [r for r in old["quality"] if (r["blocks"], r["trial_s"]) not in wanted]
        cost = old["cost"]
    for blocks, trial_s in settings:
        if a.only and (blocks, trial_s) not in wanted:
            continue
        for problem in PROBLEMS:
            for method in METHODS:
                runs = [sweep(method, problem, s, blocks, trial_s) for s in seeds]
                share = [r["model_share"] for r in runs if r["model_share"] is not None]
                row = {"blocks": blocks, "trial_s": trial_s, "problem": problem, "method": method,
                       "median_regret": float(np.median([r["regret"] for r in runs])),
                       "model_share": float(np.mean(share)) if share else None,
                       "wall_s": float(np.mean([r["wall_s"] for r in runs]))}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if cost is None or not a.only:
        cost = cost_at_1000()
    print(json.dumps(cost), flush=True)
    md = [f"Median regret after 50 evaluations over {len(seeds)} seeds (lower is better); "
          "'model' is the share of mpilearn gp's post-initial suggestions that came from the GP.", "",
          "| blocks | trial | problem | mpilearn gp | model | mpilearn random | Optuna TPE | Optuna GP |",
          "|---|---|---|---|---|---|---|---|"]
    for blocks, trial_s in settings:
        for problem in PROBLEMS:
            get = {r["method"]: r for r in rows if (r["blocks"], r["trial_s"], r["problem"])
                   == (blocks, trial_s, problem)}
            if not get:
                continue
            md.append(f"| {blocks} | {'instant' if trial_s == 0 else f'~{trial_s:g} s'} | {problem} | "
                      f"{get['mpilearn-gp']['median_regret']:.4g} | "
                      f"{get['mpilearn-gp']['model_share']:.0%} | "
                      + " | ".join(f"{get[m]['median_regret']:.4g}" for m in METHODS[1:]) + " |")
    md += ["", "| cost at 1000 observations (6-D, mpilearn gp) | seconds | target |", "|---|---|---|",
           f"| resume: replay 1000 finished trials + first model suggestion | {cost['resume_1000_s']:.2f} | <= 10 |",
           f"| one tell + ask, kernel fixed ({cost['tell_ask_fixed_kernel_observations']} obs) | "
           f"{cost['tell_ask_fixed_kernel_s']:.2f} | <= 2 |",
           f"| one tell + ask with the hyperparameter refit ({cost['tell_ask_hyper_refit_observations']} obs) | "
           f"{cost['tell_ask_hyper_refit_s']:.2f} | <= 2 |"]
    write(a.out, {"quality": rows, "cost": cost}, md)


if __name__ == "__main__":
    main()
