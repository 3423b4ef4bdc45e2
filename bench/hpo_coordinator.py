"""HPO coordinator overhead: decision latency vs observations, and block utilisation.

    python bench/hpo_coordinator.py [--quick]

1. Decision latency: for gp, evolution and random with N observations already told (8-D
   Hartmann-like objective), the time the coordinator takes to answer one block: a tell of the
   block's result plus a get of its next trial, through the same Prefetcher the coordinator
   uses, at one request per 10 ms. Also what the background thread absorbs per batch (one
   tell with its refit, plus 8 suggestions), and the fraction of decisions served by the
   random fallback because the thread had nothing ready.
2. Simulated sweep: 64 blocks, trial durations uniform in [0.3, 0.9] s (mean 60 s scaled
   100x), real searcher and prefetcher; utilisation = trial time / (trial time + decision
   time), per block, with the decision time measured in real (unscaled) seconds.
Writes bench/results/hpo_coordinator.{json,md}.
"""
import argparse
import heapq
import json
import os
import time

import numpy as np

from common import write
from mpilearn.hpo.prefetch import Prefetcher
from mpilearn.hpo.searchers import make_searcher
from mpilearn.hpo.space import Space

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIMS = 8


def objective(p):
    x = np.array([p[f"x{i}"] for i in range(DIMS)])
    return float(np.sum((x - 0.3) ** 2) + 0.1 * np.sin(10 * x).sum())


def space():
    return Space.from_config({f"x{i}": {"type": "real", "low": 0.0, "high": 1.0} for i in range(DIMS)})


def primed(name, n, seed=0):
    s = make_searcher(name, space(), seed, n_initial=10)
    rng = np.random.default_rng(seed)
    pts = [space().sample(rng) for _ in range(n)]
    s.tell_many([(p, objective(p)) for p in pts])
    s.asked = n
    if hasattr(s, "initial_handed"):  # as a resumed sweep: its initial points handed out
        s.initial_handed = s.n_initial
    return s


def latency(name, n, decisions):
    s = primed(name, n)
    # what the background thread absorbs per batch: one tell (a GP refit) and 8 suggestions
    extra = space().sample(np.random.default_rng(99))
    t = time.perf_counter()
    s.tell(extra, objective(extra))
    _ = s.ask_many(8)
    raw_ask = time.perf_counter() - t
    pool = Prefetcher(s, ahead=8)
    time.sleep(0.2)
    lat = []
    for _ in range(decisions):
        time.sleep(0.01)  # blocks report at most every 10 ms
        t = time.perf_counter()
        p, _ = pool.get()
        pool.tell(p, objective(p))
        lat.append(time.perf_counter() - t)
    fallbacks = pool.fallbacks
    pool.close()
    return {"searcher": name, "observations": n, "p50_ms": 1e3 * float(np.percentile(lat, 50)),
            "p95_ms": 1e3 * float(np.percentile(lat, 95)), "raw_ask_s": raw_ask,
            "fallback_fraction": fallbacks / decisions}


def simulated_sweep(name, blocks, trials, seed=0):
    s = make_searcher(name, space(), seed, n_initial=10)
    pool = Prefetcher(s, ahead=blocks)
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    busy = np.zeros(blocks)
    deciding = np.zeros(blocks)
    events, dispatched = [], 0
    for b in range(blocks):
        t = time.perf_counter()
        p, _ = pool.get()
        deciding[b] += time.perf_counter() - t
        d = rng.uniform(0.3, 0.9)
        heapq.heappush(events, (time.perf_counter() + d, b, p, d))
        dispatched += 1
    while events:
        end, b, p, d = heapq.heappop(events)
        wait = end - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        busy[b] += d
        t = time.perf_counter()
        pool.tell(p, objective(p))
        if dispatched < trials:
            p, _ = pool.get()
            dispatched += 1
            deciding[b] += time.perf_counter() - t
            d = rng.uniform(0.3, 0.9)
            heapq.heappush(events, (time.perf_counter() + d, b, p, d))
        else:
            deciding[b] += time.perf_counter() - t
    fallbacks = pool.fallbacks
    pool.close()
    util = busy / (busy + deciding)
    return {"searcher": name, "blocks": blocks, "trials": trials,
            "utilisation_mean": float(util.mean()), "utilisation_min": float(util.min()),
            "wall_s": time.perf_counter() - start, "fallback_fraction": fallbacks / trials}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "hpo_coordinator"))
    a = ap.parse_args()
    sizes = (10, 100) if a.quick else (10, 50, 100, 200, 500)
    rows = []
    for name in ("random", "evolution", "gp"):
        for n in sizes:
            r = latency(name, n, 20 if a.quick else 60)
            rows.append(r)
            print(json.dumps(r), flush=True)
    sweeps = [simulated_sweep(name, 64, 128 if a.quick else 500) for name in ("random", "evolution", "gp")]
    for s in sweeps:
        print(json.dumps(s), flush=True)
    md = ["| searcher | observations | decision p50 (ms) | decision p95 (ms) | thread: tell + 8 asks (s) | random fallbacks |",
          "|---|---|---|---|---|---|"]
    md += [f"| {r['searcher']} | {r['observations']} | {r['p50_ms']:.2f} | {r['p95_ms']:.2f} | "
           f"{r['raw_ask_s']:.2f} | {r['fallback_fraction']:.0%} |" for r in rows]
    md += ["", "| searcher | blocks | trials | utilisation mean | min | random fallbacks |",
           "|---|---|---|---|---|---|"]
    md += [f"| {s['searcher']} | {s['blocks']} | {s['trials']} | {s['utilisation_mean']:.4f} | "
           f"{s['utilisation_min']:.4f} | {s['fallback_fraction']:.0%} |" for s in sweeps]
    write(a.out, {"latency": rows, "sweeps": sweeps}, md)


if __name__ == "__main__":
    main()
