"""The sweep's append-only journal: one JSON line per event, written only by the coordinator.

Events:
``started`` (key, trial, params, block, origin, config: the number of the config in
``config-history/`` it ran under), ``progress`` (key, fold, epoch, value: one
fold's report), ``verdict`` (key, trial, step, value = mean over the folds, prune: the pruner's
answer), ``done`` (key, values = per objective the mean over folds, value = the first, std,
fold_values, wall), ``pruned`` (key, step and value where it stopped), ``failed`` (key, reason,
killed: its job died under it), ``interrupted`` (key, folds with each fold's wall so far: in
flight when the job was stopped), ``exhausted`` (a finite space has no untried point left),
``job`` (a job of the sweep started: the first run or a resume; config as for started),
``block_lost`` (block, reason: a rank lost under ULFM, ``hpo/elastic.py``; its trial's
``interrupted`` follows).
Resume = replay.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, List

from ..core.io import append_jsonl, append_jsonl_many, read_jsonl


@dataclass
class SweepState:
    started: Dict[str, dict] = field(default_factory=dict)   # key -> started event
    finished: Dict[str, dict] = field(default_factory=dict)  # key -> done/failed event
    order: List[str] = field(default_factory=list)           # keys in start order
    pruning: List[tuple] = field(default_factory=list)  # ("report", trial, step, value) |
                                                        # ("complete", trial), in order
    prior_wall: Dict[str, Dict[int, float]] = field(default_factory=dict)  # key -> fold -> s

    @property
    def in_flight(self) -> List[str]:
        return [k for k in self.order if k not in self.finished]

    def n_trials(self) -> int:
        return len(self.started)


class Journal:
    def __init__(self, path: str):
        self.path = path
        self._group = None  # events of the open group commit, not yet on disk

    def write(self, event: str, **fields) -> None:
        record = {"event": event, "time": time.time(), **fields}
        if self._group is not None:
            self._group.append(record)
        else:
            append_jsonl(self.path, record)

    @contextmanager
    def group(self):
        """Events written inside reach the disk together, with one fsync, when it ends (also
        on an error): at a thousand blocks one fsync per event would be the bottleneck. The
        coordinator answers the blocks only after the group is on disk."""
        self._group = []
        try:
            yield
        finally:
            records, self._group = self._group, None
            if records:
                append_jsonl_many(self.path, records)

    def replay(self) -> SweepState:
        state = SweepState()
        for rec in read_jsonl(self.path):
            key = rec.get("key")
            kind = rec.get("event")
            if kind == "started" and key not in state.started:
                state.started[key] = rec
                state.order.append(key)
            elif kind == "failed" and rec.get("killed"):
                continue  # its job died under it: it runs again
            elif kind in ("done", "failed", "pruned"):
                state.finished[key] = rec
                if kind == "done":
                    state.pruning.append(("complete", state.started[key]["trial"]))
            elif kind == "interrupted":  # a fold's wall counts every session so far
                state.prior_wall[key] = {f["fold"]: f["wall"] for f in rec.get("folds", [])
                                         if "wall" in f and "fold" in f}
            elif kind == "verdict":
                state.pruning.append(("report", rec["trial"], rec["step"], rec["value"]))
        return state
