"""Suggestions computed ahead of the coordinator, in a thread, with tells batched into one
model update: a slow searcher (the GP) never blocks a block waiting for work."""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .searchers import Searcher
from .space import KeyView, trial_key


class Prefetcher:
    """Keeps up to ``ahead`` suggestions ready; asks and tells run in a background thread.

    Results are applied in batches (one model update for all of them). Few suggestions are
    kept ready (``ahead``, a quarter of the blocks), so that each comes from a recent model,
    computed with every busy block's point believed (see ``searchers.GPSearcher``).
    ``get(wait)`` hands out a ready suggestion; with
    none ready it waits up to ``wait`` seconds for one being computed, then hands out a
    *fallback* (a random point not tried yet), so a block never idles long on the model. When
    a finite space has no untried point left, ``get`` returns None. ``take(give_up)`` is the
    same without waiting: the coordinator keeps serving other blocks meanwhile.
    """

    def __init__(self, searcher: Searcher, ahead: int, known_keys=(), pending=(), enqueued=()):
        self.searcher, self.ahead = searcher, max(1, ahead)
        # key -> (point, origin), oldest first; keyed so that a batch's exclude reads it
        # live: rebuilding the keys per round (30-60 us a key) took 0.1-0.25 s under the
        # lock at 16 384 blocks (4 096 ready), a round per hand-out, and random search's
        # decisions waited for it (p50 33 ms; 98.7 % busy)
        self.ready: Dict[str, Tuple[Dict[str, Any], str]] = {
            trial_key(p): (p, "enqueued") for p in enqueued}
        self.pending_tells: List[tuple] = []
        self.known = set(known_keys)                           # keys handed out
        self.busy = {trial_key(p): p for p in pending}         # handed out, no result yet
        self.fallbacks = 0
        self.computing = False
        self._requested, self._seen = 1, 0  # rounds asked for / started: the first at once
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="mpilearn-searcher", daemon=True)
        self._thread.start()
        self._wake.set()

    def _run(self):
        try:
            while not self._stop:
                self._wake.wait()
                self._wake.clear()
                while not self._stop:
                    with self._lock:
                        self._seen = self._requested
                        tells, self.pending_tells = self.pending_tells, []
                        need = self.ahead - len(self.ready)
                        busy = list(self.busy.values()) + [p for p, _ in self.ready.values()]
                        # live: the main thread's hand-outs join it as the batch is made
                        exclude = KeyView(self.known, self.ready)
                        self.computing = need > 0 or bool(tells)
                    if tells:
                        self.searcher.tell_many(tells)
                    got = self.searcher.ask_many(need, busy, exclude) if need > 0 else []
                    keyed = [(trial_key(p), (p, o)) for p, o in got]
                    with self._lock:
                        self.ready.update((k, po) for k, po in keyed if k not in self.known)
                        self.computing = False
                        more = self._requested != self._seen
                    if not more and (need <= 0 or len(got) < need):
                        break  # full, or nothing more to offer until new results arrive
        except BaseException as err:  # reported by the coordinator on its next get()
            self.error = err
            self.computing = False

    WAIT = ("wait", None)  # take(): the model is computing; ask again

    def take(self, give_up: bool):
        """A ready suggestion and its origin; while the model is still computing one and not
        ``give_up``, ``WAIT``; else a fallback; None when a finite space is exhausted."""
        if self.error is not None:
            raise self.error
        with self._lock:
            while self.ready:
                key = next(iter(self.ready))
                point, origin = self.ready.pop(key)
                if key not in self.known:
                    return self._hand_out(point, origin)
            computing = self.computing or self._requested != self._seen
        self._wake.set()
        if computing and not give_up:
            return self.WAIT
        point = self._untried()
        if point is None:
            return None
        self.fallbacks += 1
        with self._lock:
            return self._hand_out(point, "fallback")

    def get(self, wait: float = 0.0) -> Optional[Tuple[Dict[str, Any], str]]:
        """A suggestion and its origin, waiting up to ``wait`` seconds for the model, or None
        when a finite space is exhausted."""
        import time

        deadline = time.monotonic() + wait
        while True:
            got = self.take(give_up=time.monotonic() >= deadline)
            if got is not self.WAIT:
                return got
            time.sleep(0.002)

    def _hand_out(self, point, origin):
        key = trial_key(point)
        self.known.add(key)
        self.busy[key] = point
        self._requested += 1
        self._wake.set()
        return point, origin

    # a finite space up to this size is enumerated to find its untried points (and to know
    # when none is left); a larger one is sampled, as a real-valued one is
    ENUMERABLE = 100_000

    def _untried(self) -> Optional[Dict[str, Any]]:
        space = self.searcher.space
        rng = np.random.default_rng([self.searcher.seed, 10 ** 6 + self.fallbacks])
        size = space.size()
        if size is not None and size <= self.ENUMERABLE:
            rest = [p for p in space.grid() if trial_key(p) not in self.known]
            return rest[int(rng.integers(len(rest)))] if rest else None
        for _ in range(100):
            point = space.sample(rng)
            if trial_key(point) not in self.known:
                return point
        return point

    def tell(self, point, loss) -> None:
        with self._lock:
            self.pending_tells.append((point, loss))
            self.busy.pop(trial_key(point), None)
            self._requested += 1
        self._wake.set()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=60)
