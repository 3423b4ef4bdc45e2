"""HDF5 event datasets: event-level sharding, seeded per-epoch shuffling, background prefetch.

Events, not files, are sharded, so 64 ranks work with 10 files. Global batch ``j`` of an epoch
is ``order[j*G:(j+1)*G]`` with ``G = local_batch * ranks``, and rank ``r`` reads the ``r``-th
slice of it: N ranks see exactly the events one rank would see with an N-times larger batch.
The read position is (epoch, events consumed in its order) (``position.py``): checkpointable,
and readable on at any other rank count.
"""
from __future__ import annotations

import os
import queue
import sys
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np

from ..errors import UsageError
from ..cluster.stage import local
from .position import rank_slice, steps_left


class DataError(OSError):
    """A data file that opened fine fails while training reads it; names file and events.
    ``where`` = (path, dataset key, first event, last event, the reader's own error): what
    :func:`one_message` groups when several ranks hit the same cause."""

    def __init__(self, message: str, where: Optional[tuple] = None):
        super().__init__(message)
        self.where = where


def one_message(failures: List[tuple]) -> str:
    """The read failures that ranks saw at one step, ``(rank, where or message)`` each, as one
    message: one entry per file, dataset and error, with the events and ranks it covers."""
    groups: Dict[tuple, list] = {}
    for rank, where in failures:
        key = (where[0], where[1], where[4]) if isinstance(where, tuple) else (where,)
        group = groups.setdefault(key, [[], []])
        group[0].append(rank)
        if isinstance(where, tuple):
            group[1] += [where[2], where[3]]
    parts = []
    for key, (ranks, events) in groups.items():
        on = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"
        if len(key) == 1:
            parts.append(key[0] + on)
        else:
            parts.append(f"{key[0]}: reading dataset '{key[1]}', events {min(events)}-"
                         f"{max(events)} of this file failed{on}: {key[2]}")
    return "; ".join(parts)


class EventFiles:
    """A list of HDF5 files seen as one table of events with the given dataset keys.
    ``on_error``: "stop" (a failing read raises DataError) or "skip" (its events are dropped
    from the batch, with a warning naming the file and events)."""

    on_error = "stop"

    def __init__(self, paths: Sequence[str], keys: Sequence[str], optional: Sequence[str] = ()):
        import h5py

        if not paths:
            raise UsageError("data.files matches no file")
        self.paths = [str(p) for p in paths]
        self.keys = list(keys)
        self.optional_present = set(optional)
        counts = []
        for path in self.paths:
            if not os.path.isfile(path):
                raise UsageError(f"data file not found: {path}")
            try:
                handle = h5py.File(local(path), "r")
            except OSError as err:
                raise UsageError(f"cannot open {path} as HDF5: {err}") from None
            with handle as f:
                n = None
                for key in self.keys:
                    if key not in f:
                        raise UsageError(f"{path}: no dataset '{key}' (has: {', '.join(sorted(f.keys()))})")
                    if not isinstance(f[key], h5py.Dataset):
                        raise UsageError(f"{path}: '{key}' is an HDF5 group, not a dataset (it "
                                         f"holds: {', '.join(sorted(f[key].keys())) or 'nothing'})")
                    length = f[key].shape[0] if f[key].shape else 0
                    if n is not None and length != n:
                        raise UsageError(f"{path}: dataset '{key}' has {length} events but "
                                         f"'{self.keys[0]}' has {n}")
                    n = length
                for key in optional:
                    if key not in f:
                        self.optional_present.discard(key)
                if not n:
                    raise UsageError(f"{path}: dataset '{self.keys[0]}' holds no events")
                counts.append(n)
        self.counts = np.asarray(counts, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])
        self._handles: Dict[str, object] = {}
        self._datasets: Dict[tuple, tuple] = {}  # (file, key) -> _dataset()'s answer
        self._skipped: set = set()

    @classmethod
    def from_counts(cls, paths, counts, optional_present, keys) -> "EventFiles":
        """The index rank 0 built, rebuilt on other ranks without touching the files."""
        self = cls.__new__(cls)
        self.paths, self.keys = list(paths), list(keys)
        self.optional_present = set(optional_present)
        self.counts = np.asarray(counts, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])
        self._handles, self._datasets = {}, {}
        self._skipped = set()
        return self

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read_keys(self) -> List[str]:
        return self.keys + sorted(self.optional_present)

    def _file(self, i: int):
        import h5py

        path = self.paths[i]
        if path not in self._handles:  # a chunk cache that holds a shuffled batch's chunks
            self._handles[path] = h5py.File(local(path), "r", rdcc_nbytes=64 << 20, rdcc_nslots=10007)
        return self._handles[path]

    def read(self, indices: np.ndarray) -> Dict[str, np.ndarray]:
        """Events at global ``indices`` (any order), as a dict of arrays in that order. Each
        key's batch array is allocated once and every file's events are read straight into
        their places in it: no per-file pieces, no concatenation."""
        indices = np.asarray(indices, dtype=np.int64)
        file_of = np.searchsorted(self.offsets, indices, side="right") - 1
        files = np.unique(file_of)
        out: Dict[str, np.ndarray] = {}
        keep = np.ones(len(indices), dtype=bool)
        for i in files:
            dest = np.nonzero(file_of == i)[0] if len(files) > 1 else None
            rows = (indices if dest is None else indices[dest]) - self.offsets[i]
            try:
                for key in self.read_keys():
                    if key not in out:
                        _, _, tail, dtype = self._dataset(int(i), key)
                        out[key] = np.empty((len(indices),) + tail, dtype)
                for key in out:
                    self._read_into(int(i), key, rows, out[key], dest)
            except DataError as err:
                if self.on_error != "skip":
                    raise
                self._warn_skip(err)
                keep[slice(None) if dest is None else dest] = False
        if not keep.all():  # data.on_error=skip: drop the unreadable events, say which are left
            out = {k: v[keep] for k, v in out.items()}
            out["_index"] = indices[keep]
        return out

    def _read_into(self, i: int, key: str, rows: np.ndarray, target: np.ndarray,
                   dest: Optional[np.ndarray]) -> None:
        """Rows ``rows`` (any order) of dataset ``key`` of file ``i`` into ``target`` (at
        positions ``dest``, or all of it when None)."""
        try:
            ds, mapped, _, _ = self._dataset(i, key)
            if mapped is None:  # chunked or compressed: HDF5 reads (and inflates) the chunks
                _read_runs(ds, rows, target, dest)
            elif dest is None:  # contiguous, uncompressed: gather from the page cache
                # mode="clip": the rows are in range, and "raise" makes numpy buffer ``out``
                np.take(mapped, rows, axis=0, out=target, mode="clip")
            else:
                target[dest] = mapped[rows]
        except (OSError, ValueError, RuntimeError) as err:  # e.g. a corrupt gzip chunk
            raise DataError(f"{self.paths[i]}: reading dataset '{key}', events "
                            f"{rows.min()}-{rows.max()} of this file failed: {err}",
                            (self.paths[i], key, int(rows.min()), int(rows.max()), str(err))) from None

    def _dataset(self, i: int, key: str):
        """(dataset, memory map or None, event shape, dtype) of ``key`` in file ``i``, looked up
        once: h5py's name lookups and attribute reads cost tens of microseconds each. The map
        is made for a contiguous, uncompressed dataset, where h5py's per-selection overhead,
        not the disk, is the cost."""
        cache = self._datasets
        if (i, key) not in cache:
            try:
                ds = self._file(i)[key]
                contiguous = ds.chunks is None and ds.compression is None
                offset = ds.id.get_offset() if contiguous else None
                mapped = None
                if offset is not None and ds.dtype.kind in "fiub" and len(ds.shape) >= 1:
                    mapped = np.memmap(self.paths[i], dtype=ds.dtype, mode="r", offset=offset,
                                       shape=ds.shape)
            except (OSError, ValueError, RuntimeError, KeyError) as err:  # e.g. truncated
                raise DataError(f"{self.paths[i]}: opening dataset '{key}' failed: {err}") from None
            cache[(i, key)] = (ds, mapped, tuple(ds.shape[1:]), ds.dtype)
        return cache[(i, key)]

    def _warn_skip(self, err: Exception) -> None:
        if str(err) not in self._skipped:
            self._skipped.add(str(err))
            sys.stderr.write(f"mpilearn: warning: data.on_error=skip: {err}; skipping those "
                             "events\n")
            sys.stderr.flush()

    def close(self) -> None:
        for h in self._handles.values():
            h.close()
        self._handles.clear()
        self._datasets.clear()


def _read_runs(ds, rows: np.ndarray, target: np.ndarray, dest: Optional[np.ndarray]) -> None:
    """``rows`` (in request order) of a chunked HDF5 dataset straight into ``target`` (at
    ``dest``, or 0..n-1), one low-level H5Dread per run of rows consecutive in both the file
    and the batch: a whole unshuffled batch is one read, a shuffled one reads event by event.
    (Measured: h5py's slicing pays ~60 us of Python per call on top of the inflation, the
    low-level read almost none; one read of a union of hyperslabs was 30x slower.)"""
    import h5py

    pos = np.arange(len(rows)) if dest is None else dest
    breaks = np.nonzero((np.diff(rows) != 1) | (np.diff(pos) != 1))[0] + 1
    starts = np.concatenate([[0], breaks]).astype(np.int64)
    ends = np.concatenate([breaks, [len(rows)]]).astype(np.int64)
    tail = tuple(ds.shape[1:])
    space = ds.id.get_space()
    memory: Dict[int, object] = {}
    for first, last in zip(starts, ends):
        count = int(last - first)
        space.select_hyperslab((int(rows[first]),) + (0,) * len(tail), (count,) + tail)
        if count not in memory:
            memory[count] = h5py.h5s.create_simple((count,) + tail)
        at = int(pos[first])
        ds.id.read(memory[count], space, target[at:at + count])


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool = True) -> np.ndarray:
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


def split_events(n: int, val_fraction: float, seed: int):
    """A fixed event-level train/validation split (same on every rank)."""
    perm = np.random.default_rng([seed, 7919]).permutation(n)
    n_val = int(round(n * val_fraction))
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


class ShardedLoader:
    """Per-rank batches of a global batch, read ahead by a background thread."""

    def __init__(self, files: EventFiles, events: np.ndarray, local_batch: int, rank: int,
                 size: int, seed: int = 0, shuffle: bool = True, prefetch: int = 4,
                 transform: Optional[Callable[[dict], dict]] = None):
        self.files, self.events = files, np.asarray(events)
        self.local_batch, self.rank, self.size = local_batch, rank, size
        self.seed, self.shuffle, self.prefetch = seed, shuffle, max(1, prefetch)
        self.transform = transform
        self.global_batch = local_batch * size
        self.steps_per_epoch = len(self.events) // self.global_batch
        self.wait_seconds = 0.0
        if self.steps_per_epoch == 0:
            raise UsageError(f"{len(self.events)} training events cannot fill one global batch of "
                             f"{self.global_batch} ({local_batch} per rank x {size} ranks)")

    def reshard(self, rank: int, size: int, local_batch: Optional[int] = None) -> None:
        """Another rank count (and per-rank batch) from the next ``batches()`` on."""
        self.rank, self.size = rank, size
        self.local_batch = local_batch or self.local_batch
        self.global_batch = self.local_batch * size
        self.steps_per_epoch = len(self.events) // self.global_batch

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's global event order (event indices), the same on every rank count."""
        if getattr(self, "_order_epoch", None) != epoch:  # one permutation per epoch, not per step
            self._order = self.events[epoch_order(len(self.events), epoch, self.seed, self.shuffle)]
            self._order_epoch = epoch
        return self._order

    def local_indices(self, epoch: int, position: int) -> np.ndarray:
        """This rank's events of the global batch that starts ``position`` events into the epoch."""
        return rank_slice(self.order(epoch), position, self.rank, self.local_batch)

    def _read(self, epoch: int, position: int) -> dict:
        index = self.local_indices(epoch, position)
        batch = self.files.read(index)
        batch.setdefault("_index", index)  # read() gives the kept ones when it skipped some
        return self.transform(batch) if self.transform else batch

    def batches(self, epoch: int, position: int = 0, steps: Optional[int] = None) -> Iterator[dict]:
        """Yields this rank's batches of the epoch from ``position`` (events consumed) on: all
        whole global batches left, or the first ``steps`` of them."""
        count = steps_left(len(self.events), position, self.global_batch)
        count = count if steps is None else min(count, steps)
        q: "queue.Queue" = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def produce():
            try:
                for k in range(count):
                    item = self._read(epoch, position + k * self.global_batch)
                    while not stop.is_set():
                        try:
                            q.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                q.put(StopIteration)
            except BaseException as err:  # handed to the consumer, which raises it
                q.put(err)

        thread = threading.Thread(target=produce, name="mpilearn-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                t0 = time.perf_counter()
                item = q.get()
                self.wait_seconds += time.perf_counter() - t0
                if item is StopIteration:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            thread.join(timeout=5)

    def pop_wait(self) -> float:
        s, self.wait_seconds = self.wait_seconds, 0.0
        return s


def eval_batches(files: EventFiles, events: np.ndarray, local_batch: int, rank: int, size: int,
                 transform=None) -> Iterator[dict]:
    """This rank's share of the validation events (uneven shares are fine: no collectives)."""
    mine = np.asarray(events)[rank::size]
    for start in range(0, len(mine), local_batch):
        batch = files.read(mine[start:start + local_batch])
        yield transform(batch) if transform else batch
