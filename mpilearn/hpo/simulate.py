"""A sweep with simulated blocks: one rank plays many blocks against the real coordinator.

    mpirun -np 2 python -m mpilearn.hpo.simulate --workers 64 --out DIR [--searcher gp]
        [--evals-per-worker 10] [--problem hartmann6|branin|ackley10] [--median-s 0.5] [--resume]
        [--fail-fraction 0.01 [--hang-share 0.5] [--hang-s S]]

Rank 0 runs the sweep's own :class:`Coordinator` with its journal, searcher, prefetcher and
pruner: the code ``python -m mpilearn.optimize`` runs. Rank 1 plays N blocks. Each one sends
what a real block leader sends (``TAG_BLOCK``: its block number and its last result) and
takes its next trial from the answer (``TAG_TRIAL``). A trial lasts a log-normal time (the
spread of real trials) and returns a noisy Hartmann-6, Branin or Ackley-10 value.

Why this is faithful to N real blocks: the coordinator probes any source and answers one
message at a time in either case, and the messages are the same, so it cannot tell the two
apart. The only difference is the sender. MPI keeps one sender's messages to one receiver in
order, so rank 1 pairs each answer with the block that asked first (a trial names its block;
a release does not, see ``play``). Rank 1 is an event loop
(no thread per block). A block's wait is counted from the moment its trial ends, so the
simulator's own lag counts against utilisation and never for it.

Failures (``--fail-fraction``): that share of the blocks fails once, in one of the first half
of its trials, at a random point of it. Half of them (``--hang-share``) hang: the block makes no progress for
``--hang-s`` (the watchdog's time), then says so and is reset (it asks for a new trial). The
others vanish: they report the loss (what ULFM's failure notice tells the coordinator) and
never ask again. Either way the coordinator journals the trial as interrupted and gives it to
the next block that asks (``Coordinator.lose``). The lost part of the trial counts as idle
time, and a vanished block's capacity ends at its failure ("surviving capacity").
``idle_parts_s`` in sim.json says where the idle capacity went (block-seconds; with the
trials' time they add up to the windows): waits for a trial, waits for a release (a spare
held back, the sweep's end), the lost part of failed trials and the hangs' watchdog time.

Time is real (wall-clock), not virtual: the coordinator's group commits, the model thread and
the GIL compete as they do in a sweep. Short trials therefore test the coordinator harder
than real, minutes-long ones would.
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import sys
import time

import numpy as np

from . import benchmarks
from .coordinator import TAG_BLOCK, TAG_TRIAL, Coordinator
from .journal import Journal
from .space import Space

TAG_STATS = 91
PROBLEMS = {"hartmann6": (benchmarks.hartmann6, benchmarks.HARTMANN6_MIN, 0.1),
            "branin": (benchmarks.branin, benchmarks.BRANIN_MIN, 2.0),
            "ackley10": (benchmarks.ackley10, benchmarks.ACKLEY10_MIN, 0.1),
            "gan3d_like": (benchmarks.gan3d_like, benchmarks.GAN3D_LIKE_MIN, 0.2)}  # f, min, noise sd


def duration(seed: int, trial: int, median_s: float, sigma: float) -> float:
    """A trial's length: log-normal, a function of (seed, trial) so a requeued trial keeps it."""
    return float(median_s * np.exp(sigma * np.random.default_rng([seed, 7, trial]).normal()))


def noisy_value(problem: str, params: dict, seed: int, trial: int) -> tuple:
    """(observed value with Gaussian noise, true value); (None, None): the trial failed."""
    func, _, noise = PROBLEMS[problem]
    true = func(params)
    if true is None:
        return None, None
    true = float(true)
    return true + noise * float(np.random.default_rng([seed, 11, trial]).normal()), true


def failures(workers: int, evals: int, seed: int, fraction: float, hang_share: float) -> dict:
    """block -> (its n-th trial fails, at this fraction of it, 'hang' or 'vanish')."""
    rng = np.random.default_rng([seed, 13])
    count = int(round(fraction * workers))
    blocks = rng.choice(workers, size=min(count, workers), replace=False)
    hangs = int(round(hang_share * len(blocks)))
    # in the first half of its share: a block gets about ``evals`` trials, not exactly
    return {int(b): (int(rng.integers(max(1, evals // 2))), float(rng.uniform(0.1, 0.9)),
                     "hang" if i < hangs else "vanish") for i, b in enumerate(blocks)}


def play(comm, workers: int, problem: str, seed: int, median_s: float, sigma: float,
         fail: dict = None, hang_s: float = 0.0) -> dict:
    """Rank 1: N blocks in one event loop until the coordinator has no trial left for any;
    ``fail``: the blocks that fail (:func:`failures`)."""
    fail = dict(fail or {})
    started = np.zeros(workers, dtype=int)  # trials each block has started
    lost = []                   # (block, kind, trial)
    start = time.perf_counter()
    asking = {}                 # block -> since: requests in the order sent
    running = []                # heap of (end, block, trial, seconds)
    busy, window = np.zeros(workers), np.zeros(workers)
    trials = []                 # per finished trial: trial number, end (s), true value
    waits = []                  # per answer: seconds from the request (or trial end) to it
    # where the blocks' idle time went (block-seconds): with busy, they add up to the windows
    gaps = {"trial_wait_s": 0.0, "release_wait_s": 0.0, "lost_work_s": 0.0, "hang_s": 0.0}
    for block in range(workers):
        comm.send({"block": block, "result": None}, dest=0, tag=TAG_BLOCK)
        asking[block] = start
    while asking or running:
        idle = True
        while asking and comm.Iprobe(source=0, tag=TAG_TRIAL):
            trial = comm.recv(source=0, tag=TAG_TRIAL)
            now = time.perf_counter()
            if trial is None:  # released: its window ends here
                block, since = next(iter(asking.items()))
                del asking[block]
                waits.append(now - since)
                gaps["release_wait_s"] += now - since  # a spare held, or the sweep's end
                window[block] = now - start
                continue
            block = trial["block"]
            if block not in asking:
                # the coordinator held a spare back (Coordinator.SPARES) and released a
                # later block: a release names no block, so the one taken for it was this
                # one. The blocks swap: the windows' sum (the capacity) stays exact
                other = next(iter(asking))
                window[other], window[block] = window[block], 0.0
                asking[block] = asking.pop(other)
            waits.append(now - asking.pop(block))
            gaps["trial_wait_s"] += waits[-1]
            seconds = duration(seed, trial["trial"], median_s, sigma)
            nth, at, kind = fail.get(block, (-1, 0.0, ""))
            if started[block] == nth:  # this one fails part-way: its report comes then
                del fail[block]
                part = at * seconds
                end = now + part + (hang_s if kind == "hang" else 0.0)
                heapq.heappush(running, (end, block, {**trial, "fails": kind, "began": now}, part))
            else:
                heapq.heappush(running, (now + seconds, block, trial, seconds))
            started[block] += 1
            idle = False
        now = time.perf_counter()
        while running and running[0][0] <= now:
            end, block, trial, seconds = heapq.heappop(running)
            if trial.get("fails"):  # the work done is lost: not busy time
                kind = trial["fails"]
                gaps["lost_work_s"] += seconds
                gaps["hang_s"] += end - trial["began"] - seconds  # the watchdog's wait
                lost.append((block, kind, trial["trial"]))
                reason = ("stuck: no progress for the watchdog's time (simulated)"
                          if kind == "hang" else "rank 0 of the block lost (simulated)")
                comm.send({"block": block, "lost": reason, "retired": kind == "vanish"},
                          dest=0, tag=TAG_BLOCK)
                if kind == "vanish":
                    window[block] = end - start
                else:
                    asking[block] = end
                idle = False
                continue
            value, true = noisy_value(problem, trial["params"], seed, trial["trial"])
            busy[block] += seconds
            trials.append((trial["trial"], end - start, true))
            fold = ({"fold": 0, "status": "done", "values": [value], "wall": seconds}
                    if value is not None else
                    {"fold": 0, "status": "failed", "reason": "diverged (simulated)", "wall": seconds})
            comm.send({"block": block, "result": {"folds": [fold], "wall": seconds}},
                      dest=0, tag=TAG_BLOCK)
            asking[block] = end
            idle = False
        if idle:
            nxt = running[0][0] - time.perf_counter() if running else 0.0005
            time.sleep(min(max(nxt, 0.0), 0.0005))
    return {"busy_s": busy.tolist(), "window_s": window.tolist(), "trials": trials, "wait_s": waits,
            "wall_s": time.perf_counter() - start, "lost": lost, "idle_parts_s": gaps}


def coordinate(comm, searcher, journal_path: str, workers: int, budget: int) -> dict:
    """Rank 0: the sweep's coordinator over ``workers`` blocks."""
    import resource

    journal = Journal(journal_path)
    state = journal.replay()
    config = {"search": {"budget": budget, "folds": 1, "fold_mode": "parallel", "enqueue": []}}
    coordinator = Coordinator(comm, config, searcher, journal, state, workers, progress=False)
    comm.Barrier()  # the blocks start once the coordinator is up (as mpilearn.optimize's wait)
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    coordinator.run()
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {"latency_s": coordinator.latencies, "queued": coordinator.queued,
            "decision_cpu_s": coordinator.cpu_times,
            "fallbacks": coordinator.pool.fallbacks,
            "process_cpu_s": (after.ru_utime + after.ru_stime) - (cpu.ru_utime + cpu.ru_stime)}


def run(comm, make_searcher_fn, args) -> dict:
    """Both ranks; rank 0 returns the coordinator's and the blocks' numbers (None elsewhere)."""
    from ..errors import UsageError

    journal = os.path.join(args.out, "journal.jsonl")
    # every rank checks (same answer everywhere), so a bad start ends both, never one
    if comm.Get_size() != 2:
        raise UsageError(f"run it on 2 ranks (mpirun -np 2), not {comm.Get_size()}: rank 0 "
                         "coordinates, rank 1 plays the blocks")
    if not 0 <= args.fail_fraction <= 1 or not 0 <= args.hang_share <= 1:
        raise UsageError("--fail-fraction and --hang-share must be between 0 and 1")
    if args.workers < 1 or args.evals_per_worker < 1:
        raise UsageError("--workers and --evals-per-worker must be at least 1")
    if os.path.exists(journal) and not args.resume:
        raise UsageError(f"{journal} exists; pass --resume to continue it")
    space = Space.from_config(benchmarks.space(args.problem))
    searcher = make_searcher_fn(space, args.seed)  # bad --options: exit 2 here, on both ranks
    comm.Barrier()  # the checks passed on both ranks
    os.makedirs(args.out, exist_ok=True)
    if comm.Get_rank() == 1:
        comm.Barrier()  # the coordinator is up
        fail = failures(args.workers, args.evals_per_worker, args.seed, args.fail_fraction,
                        args.hang_share) if args.fail_fraction > 0 else {}
        hang_s = args.median_s if args.hang_s is None else args.hang_s
        comm.send(play(comm, args.workers, args.problem, args.seed, args.median_s, args.sigma,
                       fail, hang_s), dest=0, tag=TAG_STATS)
        return None
    stats = coordinate(comm, searcher, journal, args.workers,
                       args.workers * args.evals_per_worker)
    stats.update(comm.recv(source=1, tag=TAG_STATS))
    stats.update({k: v for k, v in vars(args).items() if k != "options"})
    with open(os.path.join(args.out, "sim.json"), "w") as f:
        json.dump(stats, f)
    return stats


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpilearn.hpo.simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, required=True, help="simulated blocks")
    p.add_argument("--evals-per-worker", type=int, default=10, help="budget = workers x this")
    p.add_argument("--searcher", default="gp")
    p.add_argument("--options", default="{}", help="search.options as JSON")
    p.add_argument("--problem", choices=sorted(PROBLEMS), default="hartmann6")
    p.add_argument("--median-s", type=float, default=0.5, help="median trial length (s)")
    p.add_argument("--sigma", type=float, default=0.5, help="log-normal spread of trial lengths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="directory for journal.jsonl and sim.json")
    p.add_argument("--resume", action="store_true", help="continue the journal in --out")
    p.add_argument("--fail-fraction", type=float, default=0.0,
                   help="share of the blocks that fail once, mid-trial (0.01: 1 %%)")
    p.add_argument("--hang-share", type=float, default=0.5,
                   help="share of the failing blocks that hang (the others vanish)")
    p.add_argument("--hang-s", type=float, default=None,
                   help="a hang's length until the watchdog resets the block "
                        "(default --median-s)")
    return p


def parse_options(text: str) -> dict:
    """``--options``: a JSON object of search.options; anything else is bad input."""
    from ..errors import UsageError

    try:
        options = json.loads(text)
    except json.JSONDecodeError as err:
        raise UsageError(f"--options is not JSON ({err}): {text!r}") from None
    if not isinstance(options, dict):
        raise UsageError(f"--options must be a JSON object of search.options, not {text!r}")
    return options


def main(argv=None, make_searcher_fn=None) -> int:
    """``make_searcher_fn(space, seed)``: a searcher other than ours (a bench's peer)."""
    from ..core import comm as mcomm
    from ..errors import exit_status
    from .searchers import choose, make_searcher

    args = parser().parse_args(argv)
    world = mcomm.init().comm  # a crash on one rank ends the job with its traceback
    try:
        options = parse_options(args.options)
        run(world, make_searcher_fn or (lambda space, seed: make_searcher(
            choose(args.searcher), space, seed, **options)), args)
    except Exception as err:  # bad input: exit 2 (rank 0 says why); others abort the job
        return exit_status(err, world.Get_rank())
    return 0


if __name__ == "__main__":
    sys.exit(main())
