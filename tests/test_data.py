"""Event-level sharding, shuffling, prefetch and file checks of the HDF5 dataset."""
import h5py
import numpy as np
import pytest

from mpilearn.core.comm import UsageError
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


@pytest.mark.parametrize("layout", [{}, {"chunks": (1, 5, 4)}, {"chunks": (3, 5, 4), "compression": "gzip"}])
def test_read_matches_h5py_for_every_storage_layout(tmp_path, layout):
    """Contiguous datasets are read through a memory map, chunked ones with one HDF5 read of
    a union of hyperslabs: both give h5py's values, in the requested order, across files."""
    rng = np.random.default_rng(0)
    paths, every = [], []
    for i, n in enumerate((40, 25)):
        x = rng.normal(size=(n, 5, 4)).astype(np.float32)
        e = rng.uniform(size=n).astype(np.float64)
        path = str(tmp_path / f"f{i}.h5")
        with h5py.File(path, "w") as f:
            f.create_dataset("X", data=x, **layout)
            f.create_dataset("e", data=e)
        paths.append(path)
        every.append((x, e))
    x_all = np.concatenate([x for x, _ in every])
    e_all = np.concatenate([e for _, e in every])
    files = EventFiles(paths, ["X", "e"])
    for idx in (np.arange(5, 13), np.array([7, 3, 9, 8, 1]), np.array([64, 0, 39, 40, 12, 41, 13]),
                rng.permutation(65)):
        got = files.read(idx)
        np.testing.assert_array_equal(got["X"], x_all[idx])
        np.testing.assert_array_equal(got["e"], e_all[idx])
        assert got["X"].dtype == np.float32 and got["e"].dtype == np.float64
    files.close()


def test_resume_position_and_prefetch_error(toy_files):
    files = EventFiles(toy_files, ["X", "y"])
    loader = ShardedLoader(files, np.arange(1024), 16, 1, 2, seed=0)
    tail = list(loader.batches(2, position=30 * 32))  # 30 global batches of 2 x 16 consumed
    assert len(tail) == 2
    np.testing.assert_array_equal(tail[0]["_index"], loader.local_indices(2, 30 * 32))

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
