"""HDF5 event datasets: event-level sharding, seeded per-epoch shuffling, background prefetch.

Events, not files, are sharded, so 64 ranks work with 10 files. Global batch ``j`` of an epoch
is ``order[j*G:(j+1)*G]`` with ``G = local_batch * ranks``, and rank ``r`` reads the ``r``-th
slice of it: N ranks see exactly the events one rank would see with an N-times larger batch.
The read position is just (epoch, step), so it is checkpointable.
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


class DataError(OSError):
    """A data file that opened fine fails while training reads it; names file and events."""


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
                handle = h5py.File(path, "r")
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
        self._skipped: set = set()

    @classmethod
    def from_counts(cls, paths, counts, optional_present, keys) -> "EventFiles":
        """The index rank 0 built, rebuilt on other ranks without touching the files."""
        self = cls.__new__(cls)
        self.paths, self.keys = list(paths), list(keys)
        self.optional_present = set(optional_present)
        self.counts = np.asarray(counts, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])
        self._handles = {}
        self._skipped = set()
        return self

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read_keys(self) -> List[str]:
        return self.keys + sorted(self.optional_present)

    def _file(self, i: int):
        import h5py

        path = self.paths[i]
        if path not in self._handles:
            self._handles[path] = h5py.File(path, "r")
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
            f = self._file(int(i))
            for key in self.read_keys():
                if key not in out:
                    ds = f[key]
                    out[key] = np.empty((len(indices),) + ds.shape[1:], ds.dtype)
            try:
                for key in out:
                    self._read_into(int(i), f, key, rows, out[key], dest)
            except DataError as err:
                if self.on_error != "skip":
                    raise
                self._warn_skip(err)
                keep[slice(None) if dest is None else dest] = False
        if not keep.all():  # data.on_error=skip: drop the unreadable events, say which are left
            out = {k: v[keep] for k, v in out.items()}
            out["_index"] = indices[keep]
        return out

    def _read_into(self, i: int, f, key: str, rows: np.ndarray, target: np.ndarray,
                   dest: Optional[np.ndarray]) -> None:
        """Rows ``rows`` (any order) of dataset ``key`` of file ``i`` into ``target`` (at
        positions ``dest``, or all of it when None)."""
        ds = f[key]
        try:
            mapped = self._mapped(i, ds)
            if mapped is not None:  # contiguous, uncompressed: gather from the page cache
                if dest is None:
                    np.take(mapped, rows, axis=0, out=target)
                else:
                    target[dest] = mapped[rows]
                return
            order = np.argsort(rows, kind="stable")
            ordered = rows[order]
            if dest is None and (order[1:] > order[:-1]).all():
                _read_sorted(ds, ordered, target)  # already in file order: straight in
                return
            scratch = np.empty((len(rows),) + ds.shape[1:], ds.dtype)
            _read_sorted(ds, ordered, scratch)
            target[order if dest is None else dest[order]] = scratch
        except (OSError, ValueError, RuntimeError) as err:  # e.g. a corrupt gzip chunk
            raise DataError(f"{self.paths[i]}: reading dataset '{key}', events "
                            f"{rows.min()}-{rows.max()} of this file failed: {err}") from None

    def _mapped(self, i: int, ds) -> Optional[np.ndarray]:
        """A read-only memory map of a contiguous, uncompressed dataset (None otherwise):
        h5py's per-selection overhead is the cost there, not the disk."""
        cache = self.__dict__.setdefault("_maps", {})
        key = (self.paths[i], ds.name)
        if key not in cache:
            offset = ds.id.get_offset() if ds.chunks is None and ds.compression is None else None
            cache[key] = None
            if offset is not None and ds.dtype.kind in "fiub" and len(ds.shape) >= 1:
                cache[key] = np.memmap(self.paths[i], dtype=ds.dtype, mode="r", offset=offset,
                                       shape=ds.shape)
        return cache[key]

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
        self.__dict__.pop("_maps", None)


def _read_sorted(ds, rows: np.ndarray, target: np.ndarray) -> None:
    """Sorted ``rows`` of a (chunked, possibly compressed) HDF5 dataset into ``target`` with
    one H5Dread of a union of hyperslabs, one per run of consecutive rows: HDF5 then walks
    the chunks once, where h5py's fancy indexing (measured 20x below slicing) or a read per
    run pays h5py's per-call cost each time."""
    import h5py

    breaks = np.nonzero(np.diff(rows) != 1)[0] + 1
    starts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([starts, [len(rows)]]))
    tail = ds.shape[1:]
    space = ds.id.get_space()
    space.select_none()
    for first, count in zip(rows[starts], lengths):
        space.select_hyperslab((int(first),) + (0,) * len(tail), (int(count),) + tuple(tail),
                               op=h5py.h5s.SELECT_OR)
    memory = h5py.h5s.create_simple((len(rows),) + tuple(tail))
    ds.id.read(memory, space, target)


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

    def local_indices(self, epoch: int, step: int) -> np.ndarray:
        if getattr(self, "_order_epoch", None) != epoch:  # one permutation per epoch, not per step
            self._order = epoch_order(len(self.events), epoch, self.seed, self.shuffle)
            self._order_epoch = epoch
        start = step * self.global_batch + self.rank * self.local_batch
        return self.events[self._order[start:start + self.local_batch]]

    def _read(self, epoch: int, step: int) -> dict:
        index = self.local_indices(epoch, step)
        batch = self.files.read(index)
        batch.setdefault("_index", index)  # read() gives the kept ones when it skipped some
        return self.transform(batch) if self.transform else batch

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[dict]:
        """Yields this rank's batches for steps ``start_step..steps_per_epoch-1``."""
        q: "queue.Queue" = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def produce():
            try:
                for step in range(start_step, self.steps_per_epoch):
                    item = self._read(epoch, step)
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
