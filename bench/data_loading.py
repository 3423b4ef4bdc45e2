"""Reading the 51x51x25 format: mpilearn's dataset (event-level shuffling + prefetch thread)
vs raw h5py slicing of consecutive events, for gzip and uncompressed files.

Both sides are timed on their second pass over the file (steady state, as in every epoch
after the first): the first pass pays one-off costs, the page cache for raw h5py and, for
mpilearn's memory map of an uncompressed file, the page-table faults of its first touch.

    python bench/data_loading.py [--quick] [--out bench/results/data_loading]
"""
import argparse
import json
import os
import tempfile
import time

import h5py
import numpy as np

from common import write
from mpilearn.data.hdf5 import EventFiles, ShardedLoader
from mpilearn.calo.simulate import simulate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def raw(path, batch):
    with h5py.File(path) as f:
        ds = f["ECAL"]
        for _ in range(2):  # the second pass is timed
            t = time.perf_counter()
            n = 0
            for start in range(0, len(ds) - batch + 1, batch):
                n += len(ds[start:start + batch])
            rate = n / (time.perf_counter() - t)
    return rate


def ours(path, batch, shuffle):
    files = EventFiles([path], ["ECAL", "energy"])
    loader = ShardedLoader(files, np.arange(len(files)), batch, 0, 1, seed=0, shuffle=shuffle, prefetch=4)
    for epoch in range(2):  # the second epoch is timed
        t = time.perf_counter()
        n = sum(len(b["ECAL"]) for b in loader.batches(epoch))
        rate = n / (time.perf_counter() - t)
    files.close()
    return rate


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "data_loading"))
    a = ap.parse_args()
    events = 512 if a.quick else 2048
    tmp = tempfile.mkdtemp()
    gz = simulate(os.path.join(tmp, "gz"), events, "angle", (100, 200), 0, events, progress=False)[0]
    plain = os.path.join(tmp, "plain.h5")
    with h5py.File(gz) as src, h5py.File(plain, "w") as dst:
        for k in src:
            dst[k] = src[k][:]
    rows = []
    for label, path in (("gzip", gz), ("uncompressed", plain)):
        for batch in (16, 64):
            r = raw(path, batch)
            for shuffle in (False, True):
                o = ours(path, batch, shuffle)
                rows.append({"format": label, "batch": batch, "shuffle": shuffle,
                             "raw_events_per_s": r, "mpilearn_events_per_s": o, "ratio": o / r})
                print(json.dumps(rows[-1]), flush=True)
    write(a.out, rows, markdown(rows))


def markdown(rows):
    md = ["| format | batch | mpilearn shuffled | raw h5py (consecutive) events/s | mpilearn events/s | ratio "
          "| target >= 0.9 |", "|---|---|---|---|---|---|---|"]
    md += [f"| {r['format']} | {r['batch']} | {r['shuffle']} | {r['raw_events_per_s']:.0f} | "
           f"{r['mpilearn_events_per_s']:.0f} | {r['ratio']:.2f} | {'met' if r['ratio'] >= 0.9 else 'missed'} |"
           for r in rows]
    return md


if __name__ == "__main__":
    main()
