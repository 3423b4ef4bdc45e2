"""Search quality: best-so-far regret vs evaluations on Branin, Hartmann-6 and a noisy Branin,
for mpilearn gp, evolution and random, and Optuna's default TPE sampler (bench-only peer).

    python bench/hpo_quality.py [--quick] [--out bench/results/hpo_quality]
"""
import argparse
import os

import numpy as np

from common import write
from mpilearn.hpo import benchmarks
from mpilearn.hpo.searchers import make_searcher
from mpilearn.hpo.space import Space

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBLEMS = {"branin": (benchmarks.branin, benchmarks.BRANIN_MIN, "branin"),
            "hartmann6": (benchmarks.hartmann6, benchmarks.HARTMANN6_MIN, "hartmann6"),
            "noisy_branin": (benchmarks.noisy_branin, benchmarks.BRANIN_MIN, "branin")}


def curve(problem, n, ask, tell):
    """Best-so-far regret of the true (noise-free) value, for any ask/tell pair."""
    func, best, _ = PROBLEMS[problem]
    found, out = np.inf, []
    for _ in range(n):
        handle, p = ask()
        v = func(p)
        tell(handle, v)
        found = min(found, benchmarks.branin(p) if problem == "noisy_branin" else v)
        out.append(found - best)
    return out


def curve_ours(name, problem, seed, n):
    space = Space.from_config(benchmarks.space(PROBLEMS[problem][2]))
    options = {"gp": {"n_initial": 8}, "evolution": {"population": 8}}.get(name, {})
    s = make_searcher(name, space, seed, **options)

    def ask():
        p = s.ask()
        return p, p

    return curve(problem, n, ask, s.tell)


def curve_optuna(problem, seed, n):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spec = benchmarks.space(PROBLEMS[problem][2])
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=seed))

    def ask():
        trial = study.ask()
        return trial, {k: trial.suggest_float(k, v["low"], v["high"]) for k, v in spec.items()}

    return curve(problem, n, ask, study.tell)


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
    md = [f"| problem | gp | evolution | random | optuna TPE |  (median regret after {n} evaluations, {len(seeds)} seeds)",
          "|---|---|---|---|---|"]
    for problem in PROBLEMS:
        md.append(f"| {problem} | " + " | ".join(f"{results[(problem, s)][-1]:.4g}"
                                              for s in ("gp", "evolution", "random", "optuna-tpe")) + " |")
    write(a.out, {f"{p}/{s}": c.tolist() for (p, s), c in results.items()}, md)
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


if __name__ == "__main__":
    main()
