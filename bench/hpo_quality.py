"""Search quality: best-so-far regret vs evaluations on Branin, Hartmann-6 and a noisy Branin,
for mpilearn gp, evolution and random, and Optuna's default TPE sampler (bench-only peer).

    python bench/hpo_quality.py [--quick] [--out bench/results/hpo_quality]
"""
import argparse
import json
import os

import numpy as np

from mpilearn.hpo import benchmarks
from mpilearn.hpo.searchers import make_searcher
from mpilearn.hpo.space import Space

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBLEMS = {"branin": (benchmarks.branin, benchmarks.BRANIN_MIN, "branin"),
            "hartmann6": (benchmarks.hartmann6, benchmarks.HARTMANN6_MIN, "hartmann6"),
            "noisy_branin": (benchmarks.noisy_branin, benchmarks.BRANIN_MIN, "branin")}


def curve_ours(name, problem, seed, n):
    func, best, space_name = PROBLEMS[problem]
    s = make_searcher(name, Space.from_config(benchmarks.space(space_name)), seed, n_initial=8, population=8)
    found, out = np.inf, []
    for _ in range(n):
        p = s.ask()
        v = func(p)
        s.tell(p, v)
        # regret of the true (noise-free) value of the best point found
        true = benchmarks.branin(p) if problem == "noisy_branin" else v
        found = min(found, true)
        out.append(found - best)
    return out


def curve_optuna(problem, seed, n):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    func, best, space_name = PROBLEMS[problem]
    spec = benchmarks.space(space_name)
    found, out = np.inf, []
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=seed))
    for _ in range(n):
        trial = study.ask()
        p = {k: trial.suggest_float(k, v["low"], v["high"]) for k, v in spec.items()}
        v = func(p)
        study.tell(trial, v)
        true = benchmarks.branin(p) if problem == "noisy_branin" else v
        found = min(found, true)
        out.append(found - best)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "hpo_quality"))
    a = ap.parse_args()
    seeds, n = (range(3), 30) if a.quick else (range(10), 50)
    results = {}
    for problem in PROBLEMS:
        for name in ("gp", "evolution", "random", "optuna-tpe"):
            curves = [curve_optuna(problem, s, n) if name == "optuna-tpe" else curve_ours(name, problem, s, n)
                      for s in seeds]
            results[(problem, name)] = np.median(np.array(curves), axis=0)
            print(problem, name, f"median regret after {n}: {results[(problem, name)][-1]:.4g}", flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    json.dump({f"{p}/{s}": c.tolist() for (p, s), c in results.items()}, open(a.out + ".json", "w"))
    md = [f"| problem | gp | evolution | random | optuna TPE |  (median regret after {n} evaluations, {len(seeds)} seeds)",
          "|---|---|---|---|---|"]
    for problem in PROBLEMS:
        md.append(f"| {problem} | " + " | ".join(f"{results[(problem, s)][-1]:.4g}"
                                              for s in ("gp", "evolution", "random", "optuna-tpe")) + " |")
    open(a.out + ".md", "w").write("\n".join(md) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, problem in zip(axes, PROBLEMS):
        for s in ("gp", "evolution", "random", "optuna-tpe"):
            ax.plot(range(1, n + 1), results[(problem, s)], label=s)
        ax.set(yscale="log", title=problem, xlabel="evaluations", ylabel="median regret")
        ax.legend()
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=80)
    print("\n".join(md))


if __name__ == "__main__":
    main()
