"""The coordinator (world rank 0): hands trials to idle blocks, records results.

It never busy-waits: between messages it sleeps (1 ms growing to 20 ms), so it uses no CPU
while the blocks train; and it never lets a block idle long on the GP: suggestions come from a
:class:`Prefetcher` that computes them in a thread (a block waits for one at most a quarter of
a typical trial, between 1 and 5 s, then gets a fallback point, journalled as such). A block
waiting for the model never holds up the others: its answer is deferred, and the coordinator
goes on serving messages. Folds report their
per-epoch values here; the pruner judges each trial on the mean over its folds. Only the
coordinator writes the journal: every message waiting is decided, the events of all of them
go to disk with one fsync (a group commit), and only then are the blocks answered.
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Dict, List, Optional

import numpy as np

from ..cluster import preempt
from .journal import Journal, SweepState
from .objective import losses
from .pruners import NoPruner, make_pruner
from .prefetch import Prefetcher
from .space import trial_key

TAG_BLOCK, TAG_TRIAL, TAG_PROGRESS, TAG_VERDICT = 11, 12, 13, 14


def model_wait(walls) -> float:
    """How long a block may wait for a model suggestion being computed: a quarter of a
    typical trial (the median of the last 200), at least 1 s (a model point is worth a second), at most 5 s."""
    return min(5.0, max(1.0, 0.25 * statistics.median(walls))) if walls else 1.0


def device_hours(folds: list) -> dict:
    """A trial's cost: each fold's ranks x wall seconds (every session of it), summed."""
    hours = sum(f.get("ranks", 1) * f.get("wall", 0.0) for f in folds) / 3600
    return {"device_hours": hours,
            "device": "gpu" if any(f.get("device") == "gpu" for f in folds) else "cpu"}


class Coordinator:
    def __init__(self, comm, config: dict, searcher, journal: Journal, state: SweepState,
                 blocks: int, progress: bool = True, pruner=None, objective=None,
                 warm_start=(), config_id: int = 1, launch=None, elastic=None):
        self.comm, self.config, self.journal, self.state = comm, config, journal, state
        # under ULFM (hpo/elastic.py): {"width": ranks per block, "hosts": every world rank's}
        self.elastic = elastic
        self.failed: set = set()       # world ranks known lost
        self.lost_blocks: set = set()  # blocks retired after a lost rank
        self.lost_reasons: dict = {}   # block -> the first loss seen in it
        self.launch = launch or {}  # the job's ranks and their start-up seconds (the cost)
        self.search = config["search"]
        self.config_id = config_id  # config-history/NNNN.yaml: journalled with every trial
        self.blocks = blocks
        self.budget = self.search["budget"]
        self.obj = objective or {"signs": [1.0], "directions": ["minimize"]}
        self.pruner = pruner or make_pruner("none")
        # folds reporting the same step at once: all of them in parallel, one in sequence
        # (then the pruner judges a trial on its first fold)
        self.parallel_folds = self.search["folds"] if self.search["fold_mode"] == "parallel" else 1
        self.reports: Dict[str, Dict[int, Dict[int, float]]] = {}  # key -> step -> fold -> v
        self.stopped: Dict[str, dict] = {}                           # key -> {step, value}
        self._replay(searcher, warm_start)
        self.requeue = [state.started[k] for k in state.in_flight]
        enqueue = [p for p in self.search.get("enqueue") or []
                   if trial_key(p) not in state.started]
        # a few blocks: few points ready, each from a recent model; many: one batch from one
        # model costs about what one point does (GPSearcher at scale), so keep more ready
        ahead = -(-blocks // 4) if blocks <= 16 else min(blocks, 256)
        self.pool = Prefetcher(searcher, ahead=ahead, known_keys=self._known,
                               pending=[e["params"] for e in self.requeue], enqueued=enqueue)
        self.running: Dict[int, dict] = {}     # block -> started event
        self.latencies: List[float] = []  # seconds from a block's request to its next trial
        self.queued: List[bool] = []  # per answer: it waited in the queue for a model point
        self.cpu_times: List[float] = []       # this thread's CPU seconds per decision
        self.deferred: List[tuple] = []  # (block, rank, asked, deadline): waiting for a model point
        self.spares: List[tuple] = []  # (block, rank, asked): held back for a lost block's trial
        # recent trials' walls: how long a block may wait for a model point (see model_wait)
        self.walls = [r["wall"] for r in state.finished.values() if r.get("wall")][-200:]
        self.stop_requested = False
        self.announce_at = None  # when the stop's line is due (interrupt)
        self.exhausted = False
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=self.budget, initial=len(state.finished), desc="trials",
                            unit="trial")

    def _replay(self, searcher, warm_start) -> None:
        """Resume: the searcher learns every finished trial in one batch, the pruner replays its
        verdicts and completions in journal order; a warm start adds another sweep's results."""
        state = self.state
        searcher.asked = state.n_trials()
        if hasattr(searcher, "initial_handed"):
            searcher.initial_handed = sum(e.get("origin") == "initial" for e in state.started.values())
        results = [(state.started[k]["params"], self._loss(state.finished[k])) for k in state.order
                   if k in state.finished]
        results += [(r["params"], self._loss(r)) for r in warm_start]
        searcher.tell_many(results)
        self._known = set(state.started) | {trial_key(r["params"]) for r in warm_start}
        by_trial = {e["trial"]: k for k, e in state.started.items()}
        for entry in state.pruning:
            if entry[0] == "complete":
                self.pruner.complete(entry[1])
            elif self.pruner.report(*entry[1:]):
                self.stopped[by_trial[entry[1]]] = {"step": entry[2], "value": entry[3]}

    def _loss(self, rec: dict):
        if rec.get("status") != "done":
            return None
        values = rec.get("values", [rec.get("value")])
        return losses(values, self.obj)

    # -- dispatch ------------------------------------------------------------------------
    def _wait(self) -> float:
        return model_wait(self.walls)

    def _next_trial(self, block: int, deadline: float):
        """The block's next trial (its started event), None: no more, or ``Prefetcher.WAIT``:
        the model is computing one and the block may wait until ``deadline``."""
        if self.stop_requested or self.exhausted:
            return None
        if self.requeue:
            event = self.requeue.pop(0)
            self.journal.write("started", key=event["key"], trial=event["trial"],
                               params=event["params"], block=block, requeued=True,
                               origin=event.get("origin"), config=self.config_id)
            # each fold's wall so far: the trial's wall_time counts every session
            return {**event, "block": block,
                    "prior_wall": self.state.prior_wall.get(event["key"], {})}
        if self.state.n_trials() >= self.budget:
            return None
        got = self.pool.take(give_up=time.monotonic() >= deadline)
        if got is Prefetcher.WAIT:
            return got
        if got is None:
            self.exhausted = True
            self.journal.write("exhausted", trials=self.state.n_trials())
            print(f"mpilearn: the search space is exhausted: all {self.state.n_trials()} of its "
                  "points were tried; the sweep ends before its budget", flush=True)
            return None
        point, origin = got
        key = trial_key(point)
        event = {"key": key, "trial": self.state.n_trials(), "params": point, "block": block,
                 "origin": origin, "config": self.config_id}
        self.state.started[key] = event
        self.state.order.append(key)
        self.journal.write("started", **event)
        return event

    def _finish(self, block: int, result: dict) -> None:
        event = self.running.pop(block)
        key = event["key"]
        folds = result["folds"]
        if any(f["status"] == "interrupted" for f in folds):
            # stopped by a signal: it runs again (from its folds' checkpoints) on --resume
            self.journal.write("interrupted", key=key, block=block, folds=folds)
            self.interrupt()
            return
        failed = [f for f in folds if f["status"] != "done"]
        base = {"key": key, "folds": folds, "wall": result["wall"], "block": block,
                **device_hours(folds)}
        if key in self.stopped:
            rec = {**base, "status": "pruned", **self.stopped[key]}
        elif failed:  # killed: its job died under it; a resume runs it again
            rec = {**base, "status": "failed", "reason": failed[0]["reason"],
                   **({"killed": True} if any(f.get("killed") for f in failed) else {})}
        else:
            per_fold = np.array([f["values"] for f in folds], dtype=float)  # folds x objectives
            values = [float(v) for v in per_fold.mean(axis=0)]
            rec = {**base, "status": "done", "values": values, "value": values[0],
                   "std": float(per_fold[:, 0].std()),
                   "fold_values": [float(v) for v in per_fold[:, 0]], "params": event["params"]}
            self.pruner.complete(event["trial"])
        self.journal.write(rec["status"], **rec)
        if rec.get("wall"):
            self.walls = self.walls[-199:] + [rec["wall"]]
        self.pool.tell(event["params"], self._loss(rec))
        self.state.finished[key] = rec
        if self.bar is not None:
            sign = self.obj["signs"][0]
            done = [sign * r["value"] for r in self.state.finished.values() if r["status"] == "done"]
            best = sign * min(done) if done else None
            self.bar.set_postfix(best=f"{best:.4g}" if best is not None else "-", refresh=False)
            self.bar.update(1)

    def _verdict(self, msg: dict) -> bool:
        """A fold's report at a step. The trial's value there is the mean over its folds; the
        pruner decides once all folds running side by side have reported the step, and a
        pruned trial's folds all stop (each at its next report)."""
        self.journal.write("progress", **msg)
        key, fold, step = msg["key"], msg["fold"], msg["epoch"]
        if key in self.stopped:
            return True
        if isinstance(self.pruner, NoPruner) or (self.parallel_folds == 1 and fold != 0):
            return False
        by_fold = self.reports.setdefault(key, {}).setdefault(step, {})
        by_fold[fold] = msg["value"]
        if len(by_fold) < self.parallel_folds:
            return False
        value = float(np.mean(list(by_fold.values())))
        trial = self.state.started[key]["trial"]
        stop = self.pruner.report(trial, step, value)
        self.journal.write("verdict", key=key, trial=trial, step=step, value=value, prune=stop)
        if stop:
            self.stopped[key] = {"step": step, "value": value}
        return stop

    # -- the loop ------------------------------------------------------------------------
    # messages answered per group commit. The first message's answer waits for the whole
    # group: at 1 024 blocks, 64 held it 17 ms at p95 (0.45 ms a decision); 16 amortise the
    # fsync (0.3-1.4 ms here) as well and hold it 6 ms (bench/RESULTS.md, issue 38)
    GROUP = 16
    SWITCH_S = 0.0005  # Python's GIL switch interval while the loop runs

    def run(self) -> SweepState:
        MPI = __import__("mpi4py.MPI", fromlist=["MPI"])
        status = MPI.Status()
        active = set(range(self.blocks))
        sleep = 0.001
        # a job starts: the report's time axis, and its ranks' launched time (cost.py)
        self.journal.write("job", blocks=self.blocks, config=self.config_id, **self.launch)
        # the model thread holds the GIL up to the switch interval (5 ms) each time this loop
        # asks for it: at 1 024 blocks an answer took 17 ms at p95 for 0.85 ms of CPU
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, self.SWITCH_S))
        try:
            while active:
                if preempt.requested() is not None and not self.stop_requested:
                    self.interrupt()
                self.announce()
                waiting = self._probe(status, active)
                if not waiting and not self.deferred:
                    time.sleep(sleep)
                    sleep = min(sleep * 2, 0.02)
                    continue
                sleep = 0.001
                # blocks waiting for a model point first, then every message waiting now:
                # decided, journalled with one fsync, answered
                answers = []
                with self.journal.group():
                    answers += self._serve_deferred(active)
                    while waiting and len(answers) < self.GROUP:
                        answers += self._decide(status.Get_source(), status.Get_tag(), active)
                        waiting = self._probe(status, active)
                for dest, tag, answer, asked, queued in answers:
                    if not self._send(answer, dest, tag, active):
                        continue
                    # a trial's answer only: a release (None) held back as a spare waited
                    # for the sweep's end, not for a decision or a model point
                    if tag == TAG_TRIAL and answer is not None:
                        self.latencies.append(time.perf_counter() - asked)
                        self.queued.append(queued)
                if not answers:
                    time.sleep(0.001)  # only blocks waiting for the model: let it compute
        finally:
            self.announce(now=True)
            sys.setswitchinterval(switch)
            self.pool.close()
            if self.bar is not None:
                self.bar.close()
        return self.state

    def _probe(self, status, active: set) -> bool:
        """Is a message waiting? Under ULFM a lost rank's notice comes here first: its block
        is handled (``_ranks_lost``), and the probe is asked again."""
        MPI = __import__("mpi4py.MPI", fromlist=["MPI"])
        while True:
            try:
                return self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
            except MPI.Exception as err:
                self._failure(err, active)

    def _send(self, answer, dest: int, tag: int, active: set) -> bool:
        MPI = __import__("mpi4py.MPI", fromlist=["MPI"])
        try:
            self.comm.send(answer, dest=dest, tag=tag)
            return True
        except MPI.Exception as err:  # the block's leader was lost meanwhile
            self._failure(err, active)
            return False

    def _failure(self, err, active: set) -> None:
        from ..core.membership import is_failure
        from .elastic import describe, newly_failed

        if self.elastic is None or not is_failure(err):
            raise err
        hosts, width = self.elastic["hosts"], self.elastic["width"]
        for rank in newly_failed(self.comm, self.failed):
            block = (rank - 1) // width
            ranks = range(1 + block * width, 1 + (block + 1) * width)
            self._lose_block(block, describe([rank], hosts), active,
                             gone=all(r in self.failed for r in ranks))

    def _lose_block(self, block: int, reason: str, active: set, gone: bool) -> None:
        """A rank of ``block`` is lost: the block retires, and its trial runs again first
        elsewhere (``lose``) once the block is ``gone``: its survivors said they stopped (a
        ``retired`` message), or none is left. Until then its folds may still be writing
        their checkpoints, which the trial's next block reads. The block's leader, when
        alive, is answered no more trials (it may be waiting for one)."""
        first = block not in self.lost_blocks
        if first:
            self.lost_blocks.add(block)
            self.lost_reasons[block] = reason
            self.journal.write("block_lost", block=block, reason=reason)
        key = self.running.get(block, {}).get("key")
        if gone:
            self.lose(block, self.lost_reasons[block])
        if first:
            left = len(active - self.lost_blocks)
            print(f"mpilearn: block {block}: {reason}"
                  + (f"; its trial {key} runs again first, on another block" if key else "")
                  + f"; the sweep goes on with {left} block(s)", flush=True)
        waiting = [d for d in self.deferred + self.spares if d[0] == block]
        self.deferred = [d for d in self.deferred if d[0] != block]
        self.spares = [d for d in self.spares if d[0] != block]
        if gone:
            active.discard(block)
        for entry in waiting if not gone else ():
            if self._send(None, entry[1], TAG_TRIAL, active):
                active.discard(block)
        self._release_spares()

    def _release_spares(self) -> None:
        if self.spares and (self.requeue or not self.running or self.stop_requested):
            # a lost trial for a spare, or the last trial done: the spares are served now
            now = time.monotonic()
            self.deferred[:0] = [(b, src, at, now) for b, src, at in self.spares]
            self.spares.clear()

    def _decide(self, source: int, tag: int, active: set) -> list:
        """One message: a fold's progress (answered with a verdict) or a block's result and
        request (answered with its next trial, None: no more; or deferred while the model
        computes its point, so that the other blocks are served meanwhile)."""
        asked, cpu = time.perf_counter(), time.thread_time()
        msg = self.comm.recv(source=source, tag=tag)
        if tag == TAG_PROGRESS:
            return [(source, TAG_VERDICT, self._verdict(msg), asked, False)]
        block = msg["block"]
        if msg.get("lost") and msg.get("retired"):  # the block is gone: nothing to answer
            self._lose_block(block, msg["lost"], active, gone=True)
            return []
        if msg.get("lost"):  # its trial failed under it (a hang): the block goes on
            self.lose(block, msg["lost"])
        elif block in self.lost_blocks:  # a retired block's leader asks: no more trials
            active.discard(block)
            return [(source, TAG_TRIAL, None, asked, False)]
        elif msg.get("result") is not None:
            self._finish(block, msg["result"])
        self._release_spares()
        self.deferred.append((block, source, asked, time.monotonic() + self._wait()))
        answers = self._serve_deferred(active, only_first=True) if len(self.deferred) == 1 \
            else []
        self.cpu_times.append(time.thread_time() - cpu)
        return answers

    def _serve_deferred(self, active: set, only_first: bool = False) -> list:
        """Answer the blocks waiting for a trial, in the order they asked, while the model
        has points ready (or their wait is over: a fallback)."""
        answers = []
        while self.deferred:
            block, source, asked, deadline = self.deferred[0]
            trial = self._next_trial(block, deadline)
            if trial is Prefetcher.WAIT:
                break
            self.deferred.pop(0)
            if trial is None and self._keep_spare():
                self.spares.append((block, source, asked))
                continue
            if trial is None:
                active.discard(block)
            else:
                self.running[block] = trial
            answers.append((source, TAG_TRIAL, trial, asked, not only_first))
            if only_first:
                break
        return answers

    SPARES = 1  # blocks kept, not released, while trials run: a lost trial's next block

    def _keep_spare(self) -> bool:
        """Hold this block back instead of releasing it? While trials are in flight and the
        budget is spent, one block waits for a trial that a failed block may give back: the
        sweep still ends with its whole budget when a block fails in its last trials."""
        return (bool(self.running) and not self.stop_requested and not self.exhausted
                and len(self.spares) < self.SPARES)

    def lose(self, block: int, reason: str) -> None:
        """A block failed under its trial (a rank lost, a hang its watchdog caught): the trial
        is journalled as interrupted with the reason and runs again first, on the next block
        that asks (from its folds' checkpoints), counted once in the budget. A block with no
        trial in flight loses none."""
        if block not in self.running:
            return
        event = self.running.pop(block)
        self.journal.write("interrupted", key=event["key"], block=block, reason=reason)
        self.requeue.insert(0, self.state.started[event["key"]])

    # a plain SIGTERM may be only the consequence of another rank's death: Open MPI's launcher
    # sends it to the survivors and SIGKILLs them 0.5 s later. Its line waits this long, so
    # that the one line is the launcher's (mpilearn-run: the rank that died, and how), not it
    CONSEQUENCE_WAIT_S = 1.5

    def interrupt(self) -> None:
        """Stop dispatching (a stop signal); in-flight trials are re-queued by --resume."""
        if not self.stop_requested and self.bar is None:
            wait = self.CONSEQUENCE_WAIT_S if preempt.describe() == "SIGTERM" else 0.0
            self.announce_at = time.monotonic() + wait
        self.stop_requested = True
        self.announce()

    def announce(self, now: bool = False) -> None:
        """The stop's one line, once its wait (``CONSEQUENCE_WAIT_S``) is over, or ``now``."""
        at = getattr(self, "announce_at", None)
        if at is not None and (now or time.monotonic() >= at):
            self.announce_at = None
            print(f"mpilearn: stopping the sweep ({preempt.describe()}): no new trials; "
                  "trials in flight are recorded as interrupted", flush=True)
