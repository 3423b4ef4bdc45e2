"""bench/tf_peer_records.py: our showers, written as the original Accelarated3DGAN's TFRecords,
read back through its feature spec, are the events mpilearn's preprocessing makes, and its
file split (DivideFiles: 0.9 / 0.1 of the sorted ``Ele_*`` files) is ours."""
import glob
import os
import sys

import numpy as np
import pytest

pytest.importorskip("tensorflow")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import tf_peer_records as records  # noqa: E402


def test_records_round_trip_through_the_peers_parser(tmp_path):
    from mpilearn.calo.simulate import simulate

    train = simulate(str(tmp_path / "train"), 12, "angle", (100, 200), 1, 12, progress=False)
    test = simulate(str(tmp_path / "test"), 6, "angle", (100, 200), 2, 6, progress=False)
    info = records.write_shards(train, test, str(tmp_path / "rec"), test_events=4)
    assert (info["train_events"], info["test_events"]) == (12, 4)
    files = sorted(glob.glob(info["glob"]))
    assert len(files) == records.TRAIN_SHARDS + 1
    # the peer's DivideFiles: per particle, round(n * 0.9) files to train, the rest to test
    n = len(files)
    assert round(n * 0.9) == records.TRAIN_SHARDS and round(n * 0.1) == 1
    assert all(os.path.basename(f).split("_")[0] == "Ele" for f in files)

    expected = records.preprocessed(train)
    back = [records.read_back(f) for f in files[:-1]]
    got = {k: np.concatenate([b[k] for b in back if len(b[k])]) for k in ("X", "Y", "ang", "ecal")}
    assert got["X"].shape == (12, 1, 51, 51, 25)
    np.testing.assert_array_equal(got["X"][:, 0], expected["images"])
    np.testing.assert_array_equal(got["Y"][:, 0], expected["energy"])
    np.testing.assert_array_equal(got["ang"][:, 0], expected["angle"])
    np.testing.assert_array_equal(got["ecal"][:, 0], expected["ecal"])
    held_out = records.read_back(files[-1])
    np.testing.assert_array_equal(held_out["Y"][:, 0], records.preprocessed(test)["energy"][:4])
