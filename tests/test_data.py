"""Event-level sharding, shuffling, prefetch and file checks of the HDF5 dataset."""
import h5py
import numpy as np
import pytest

from mpilearn.comm import UsageError
from mpilearn.data.hdf5 import EventFiles, ShardedLoader, split_events


def test_rank_shards_make_up_the_single_process_batch(toy_files):
    files = EventFiles(toy_files, ["X", "y"])
    assert len(files) == 1024
    events = np.arange(len(files))
    single = ShardedLoader(files, events, 32, 0, 1, seed=3)
    shards = [ShardedLoader(files, events, 8, r, 4, seed=3) for r in range(4)]
    assert single.steps_per_epoch == shards[0].steps_per_epoch == 32
    for epoch in (0, 1):
        want = list(single.batches(epoch))
        got = [list(s.batches(epoch)) for s in shards]
        for step, batch in enumerate(want):
            joined = np.concatenate([got[r][step]["X"] for r in range(4)])
            np.testing.assert_array_equal(joined, batch["X"])
    # shuffled per epoch, deterministically
    assert not np.array_equal(single.local_indices(0, 0), single.local_indices(1, 0))
    assert np.array_equal(single.local_indices(1, 5), ShardedLoader(files, events, 32, 0, 1, seed=3).local_indices(1, 5))


def test_read_returns_requested_order_across_files(toy_files):
    files = EventFiles(toy_files, ["X", "y"])
    idx = np.array([1000, 3, 299, 300, 799, 800, 4])
    got = files.read(idx)["X"]
    every = np.concatenate([h5py.File(p)["X"][:] for p in toy_files])
    np.testing.assert_array_equal(got, every[idx])


def test_resume_position_and_prefetch_error(toy_files):
    files = EventFiles(toy_files, ["X", "y"])
    loader = ShardedLoader(files, np.arange(1024), 16, 1, 2, seed=0)
    tail = list(loader.batches(2, start_step=30))
    assert len(tail) == 2
    np.testing.assert_array_equal(tail[0]["_index"], loader.local_indices(2, 30))

    def broken(batch):
        raise ValueError("bad event")

    loader.transform = broken
    with pytest.raises(ValueError, match="bad event"):
        next(loader.batches(0))


def test_file_errors_name_file_and_key(tmp_path, toy_file):
    with pytest.raises(UsageError, match="data file not found: .*missing.h5"):
        EventFiles([str(tmp_path / "missing.h5")], ["X"])
    with pytest.raises(UsageError, match="no dataset 'Z'"):
        EventFiles([toy_file], ["X", "Z"])
    empty = tmp_path / "empty.h5"
    with h5py.File(empty, "w") as f:
        f["X"] = np.zeros((0, 3))
    with pytest.raises(UsageError, match="empty.h5: dataset 'X' holds no events"):
        EventFiles([str(empty)], ["X"])
    text = tmp_path / "text.h5"
    text.write_text("not hdf5")
    with pytest.raises(UsageError, match="cannot open .*text.h5 as HDF5"):
        EventFiles([str(text)], ["X"])
    with pytest.raises(UsageError, match="cannot fill one global batch"):
        ShardedLoader(EventFiles([toy_file], ["X"]), np.arange(10), 8, 0, 2)


def test_split_is_disjoint_and_fixed():
    a, b = split_events(100, 0.2, seed=1)
    assert len(b) == 20 and not set(a) & set(b) and len(a) + len(b) == 100
    assert np.array_equal(split_events(100, 0.2, seed=1)[1], b)
