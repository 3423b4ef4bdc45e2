"""Horovod's timeline: a Chrome trace (chrome://tracing, Perfetto) of every collective's two
phases, ``NEGOTIATE_<KIND>`` (the metadata round) and ``<KIND>`` (the data collective), one
row per tensor name, written by rank 0 as Horovod's is. ``mark_cycles`` adds a
``CYCLE_START`` mark at each submission (the engine has no background cycle)."""
from __future__ import annotations

import json
import threading
import time
from typing import Optional

_LOCK = threading.Lock()
_ACTIVE: Optional["Timeline"] = None


class Timeline:
    def __init__(self, path: str, mark_cycles: bool):
        self.file = open(path, "w")
        self.mark_cycles = mark_cycles
        self.t0 = time.time()
        self.file.write("[\n")
        self._write({"name": "process_name", "ph": "M", "pid": 0,
                     "args": {"name": "mpilearn",
                              "start_time_since_epoch_in_micros": int(self.t0 * 1e6)}})

    def _write(self, event: dict) -> None:
        self.file.write(json.dumps(event) + ",\n")

    def event(self, row: str, name: str, phase: str) -> None:
        self._write({"name": name, "ph": phase, "pid": 0, "tid": row,
                     "ts": int((time.time() - self.t0) * 1e6)})

    def close(self) -> None:
        self._write({"name": "END", "ph": "i", "pid": 0, "s": "g",
                     "ts": int((time.time() - self.t0) * 1e6)})
        self.file.seek(self.file.tell() - 2)   # drop the last ",\n": the file is valid JSON
        self.file.write("\n]\n")
        self.file.close()


def start(path: str, mark_cycles: bool, is_root: bool) -> None:
    global _ACTIVE
    with _LOCK:
        if _ACTIVE is not None:
            _ACTIVE.close()
        _ACTIVE = Timeline(path, mark_cycles) if is_root else None


def stop() -> None:
    global _ACTIVE
    with _LOCK:
        if _ACTIVE is not None:
            _ACTIVE.close()
        _ACTIVE = None


def record(row: str, name: str, phase: str, cycle: bool = False) -> None:
    """One begin ("B") or end ("E") of a phase; cheap when no timeline is running."""
    if _ACTIVE is None:
        return
    with _LOCK:
        if _ACTIVE is None:
            return
        if cycle and _ACTIVE.mark_cycles:
            _ACTIVE._write({"name": "CYCLE_START", "ph": "i", "pid": 0, "s": "g",
                            "ts": int((time.time() - _ACTIVE.t0) * 1e6)})
        _ACTIVE.event(row, name, phase)
