"""The sweep's append-only journal: one JSON line per event, written only by the coordinator.

Events: ``started`` (key, trial, params, block), ``progress`` (key, fold, epoch, value),
``done`` (key, value = mean over folds, std, folds, wall, status), ``failed`` (key, reason),
``interrupted`` (key: in flight when the job was stopped). Resume = replay.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List

from ..io import append_jsonl, read_jsonl


@dataclass
class SweepState:
    started: Dict[str, dict] = field(default_factory=dict)   # key -> started event
    finished: Dict[str, dict] = field(default_factory=dict)  # key -> done/failed event
    order: List[str] = field(default_factory=list)           # keys in start order
    progress: Dict[int, List[float]] = field(default_factory=dict)  # epoch -> values seen

    @property
    def in_flight(self) -> List[str]:
        return [k for k in self.order if k not in self.finished]

    def n_trials(self) -> int:
        return len(self.started)


class Journal:
    def __init__(self, path: str):
        self.path = path

    def write(self, event: str, **fields) -> None:
        append_jsonl(self.path, {"event": event, "time": time.time(), **fields})

    def replay(self) -> SweepState:
        state = SweepState()
        for rec in read_jsonl(self.path):
            key = rec.get("key")
            kind = rec.get("event")
            if kind == "started" and key not in state.started:
                state.started[key] = rec
                state.order.append(key)
            elif kind in ("done", "failed"):
                state.finished[key] = rec
            elif kind == "progress":
                state.progress.setdefault(rec["epoch"], []).append(rec["value"])
        return state
