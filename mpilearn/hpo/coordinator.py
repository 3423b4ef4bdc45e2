"""The coordinator (world rank 0): hands trials to idle blocks, records results.

It never busy-waits: between messages it sleeps (1 ms growing to 20 ms), so it uses no CPU
while the blocks train; and it never lets a block idle on the GP: suggestions come from a
:class:`Prefetcher` that computes them ahead in a thread (a random point when none is ready).
Only the coordinator writes the journal.
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, List, Optional

import numpy as np

from .. import preempt
from .journal import Journal, SweepState
from .searchers import Prefetcher
from .space import trial_key

TAG_BLOCK, TAG_TRIAL, TAG_PROGRESS, TAG_VERDICT = 11, 12, 13, 14


class Coordinator:
    def __init__(self, comm, config: dict, searcher, journal: Journal, state: SweepState,
                 blocks: int, progress: bool = True):
        self.comm, self.config, self.journal, self.state = comm, config, journal, state
        self.search = config["search"]
        self.blocks = blocks
        self.budget = self.search["budget"]
        # resume: the searcher relearns every finished trial, in-flight ones run again
        searcher.asked = state.n_trials()
        for key in state.order:
            rec = state.finished.get(key)
            if rec is not None:
                searcher.tell(state.started[key]["params"], rec.get("value"))
        self.requeue = [state.started[k] for k in state.in_flight]
        self.pool = Prefetcher(searcher, ahead=blocks, known_keys=state.started.keys())
        self.running: Dict[int, dict] = {}     # block -> started event
        self.latencies: List[float] = []       # seconds from a block's request to its answer
        self.stop_requested = False
        self.bar = None
        if progress:
            from tqdm import tqdm

            done = len(state.finished)
            self.bar = tqdm(total=self.budget, initial=done, desc="trials", unit="trial")

    # -- dispatch ------------------------------------------------------------------------
    def _next_trial(self, block: int) -> Optional[dict]:
        if self.stop_requested:
            return None
        if self.requeue:
            event = self.requeue.pop(0)
            self.journal.write("started", key=event["key"], trial=event["trial"],
                               params=event["params"], block=block, requeued=True)
            return {**event, "block": block}
        if self.state.n_trials() >= self.budget:
            return None
        point = self.pool.get()
        key = trial_key(point)
        event = {"key": key, "trial": self.state.n_trials(), "params": point, "block": block}
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
        values = [f.get("value") for f in folds]
        failed = [f for f in folds if f["status"] != "done"]
        if failed:
            rec = {"key": key, "status": "failed", "reason": failed[0]["reason"],
                   "folds": folds, "wall": result["wall"], "block": block}
            self.journal.write("failed", **rec)
            self.pool.tell(event["params"], None)
        else:
            rec = {"key": key, "status": "done", "value": float(np.mean(values)),
                   "std": float(np.std(values)), "fold_values": values, "folds": folds,
                   "wall": result["wall"], "block": block, "params": event["params"]}
            self.journal.write("done", **rec)
            self.pool.tell(event["params"], rec["value"])
        self.state.finished[key] = rec
        if self.bar is not None:
            best = min((r["value"] for r in self.state.finished.values() if r.get("value") is not None),
                       default=None)
            self.bar.set_postfix(best=f"{best:.4g}" if best is not None else "-", refresh=False)
            self.bar.update(1)

    def _verdict(self, msg: dict) -> bool:
        """Median stopping: stop a fold whose value is worse than the median of earlier
        trials at the same epoch (needs 3 of them)."""
        self.journal.write("progress", **msg)
        seen = self.state.progress.setdefault(msg["epoch"], [])
        stop = (self.search["scheduler"] == "median" and len(seen) >= 3
                and msg["value"] > statistics.median(seen))
        seen.append(msg["value"])
        return stop

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> SweepState:
        MPI = __import__("mpi4py.MPI", fromlist=["MPI"])
        status = MPI.Status()
        active = set(range(self.blocks))
        sleep = 0.001
        try:
            while active:
                if preempt.requested() is not None and not self.stop_requested:
                    self.interrupt()
                if not self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
                    time.sleep(sleep)
                    sleep = min(sleep * 2, 0.02)
                    continue
                sleep = 0.001
                source, tag = status.Get_source(), status.Get_tag()
                msg = self.comm.recv(source=source, tag=tag)
                if tag == TAG_PROGRESS:
                    self.comm.send(self._verdict(msg), dest=source, tag=TAG_VERDICT)
                    continue
                asked = time.perf_counter()
                block = msg["block"]
                if msg.get("result") is not None:
                    self._finish(block, msg["result"])
                trial = self._next_trial(block)
                self.latencies.append(time.perf_counter() - asked)
                self.comm.send(trial, dest=source, tag=TAG_TRIAL)
                if trial is None:
                    active.discard(block)
                else:
                    self.running[block] = trial
        finally:
            self.pool.close()
            if self.bar is not None:
                self.bar.close()
        return self.state

    def interrupt(self) -> None:
        """Stop dispatching (a stop signal); in-flight trials are re-queued by --resume."""
        if not self.stop_requested and self.bar is None:
            print(f"mpilearn: stopping the sweep ({preempt.describe()}): no new trials; "
                  "trials in flight are recorded as interrupted", flush=True)
        self.stop_requested = True
