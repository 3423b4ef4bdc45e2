"""Shower HDF5 files -> the TFRecords that recardoso/Accelarated3DGAN's gan_dataset.py reads.

The peer's RetrieveTFRecordpreprocessing parses already-preprocessed events, one tf.Example
each: ``X`` (float list, reshaped to [1, 51, 51, 25]: channels first, cells x^0.85), ``Y``
(E/100), ``ang`` (the conditioning angle, ``mtheta``), ``ecal`` (the un-powered cell sum).
The preprocessing is mpilearn's own (:class:`mpilearn.calo.format.Preprocess`, the reference's
GetDataAngleParallel: threshold, the sum > 10 filter, E/100, x^0.85), so both sides train on
the same numbers. The peer splits train and test by file (DivideFiles, 0.9 / 0.1 of the files
named ``Ele_*``, sorted): :func:`write_shards` writes nine train shards and one test shard so
that its split is exactly the train and held-out events given here.

Needs TensorFlow only to write the records (tf.io.TFRecordWriter); importable without it.
"""
from __future__ import annotations

import os

import h5py
import numpy as np

SHAPE = (1, 51, 51, 25)
TRAIN_SHARDS = 9  # + 1 test shard: DivideFiles' round(10 * 0.9) / round(10 * 0.1)


def preprocessed(paths, angle_key: str = "mtheta") -> dict:
    """All events of ``paths`` as the GAN sees them (mpilearn's preprocessing)."""
    from mpilearn.calo.format import Preprocess

    pre = Preprocess("angle", angle_key=angle_key)
    parts = []
    for path in paths:
        with h5py.File(path, "r") as h:
            batch = {k: h[k][()] for k in ("ECAL", "energy", "theta", "mtheta", "sum") if k in h}
        parts.append(pre(batch))
    return {k: np.concatenate([p[k] for p in parts]) for k in ("images", "energy", "angle", "ecal")}


def example(image, energy_label, angle, ecal) -> bytes:
    import tensorflow as tf

    def floats(values):
        return tf.train.Feature(float_list=tf.train.FloatList(value=np.asarray(values, np.float32).reshape(-1)))

    return tf.train.Example(features=tf.train.Features(feature={
        "X": floats(image), "Y": floats([energy_label]), "ang": floats([angle]),
        "ecal": floats([ecal])})).SerializeToString()


def write_records(path: str, events: dict, index=None) -> int:
    import tensorflow as tf

    index = np.arange(len(events["energy"])) if index is None else index
    with tf.io.TFRecordWriter(path) as w:
        for i in index:
            w.write(example(events["images"][i], events["energy"][i], events["angle"][i], events["ecal"][i]))
    return len(index)


def write_shards(train_h5, test_h5, folder: str, prefix: str = "Ele_VarAngleMeas_100_200",
                 test_events=None) -> dict:
    """Nine train shards and the test shard (the first ``test_events`` of ``test_h5``), named so
    that the peer's DivideFiles picks them up (particle ``Ele``) and splits them as given.
    Returns the event counts and the glob."""
    os.makedirs(folder, exist_ok=True)
    train, test = preprocessed(train_h5), preprocessed(test_h5)
    n = len(train["energy"])
    for shard, index in enumerate(np.array_split(np.arange(n), TRAIN_SHARDS)):
        write_records(os.path.join(folder, f"{prefix}_{shard:03d}.tfrecords"), train, index)
    n_test = len(test["energy"]) if test_events is None else min(test_events, len(test["energy"]))
    write_records(os.path.join(folder, f"{prefix}_{TRAIN_SHARDS:03d}.tfrecords"), test, np.arange(n_test))
    return {"train_events": n, "test_events": n_test,
            "glob": os.path.join(folder, "*.tfrecords")}


def read_back(path: str) -> dict:
    """The records through the peer's own feature spec and reshape (its gan_dataset.py
    RetrieveTFRecordpreprocessing, without the batching), as numpy: for the round-trip test."""
    import tensorflow as tf

    spec = {"X": tf.io.FixedLenSequenceFeature((), dtype=tf.float32, allow_missing=True),
            "Y": tf.io.FixedLenFeature((), dtype=tf.float32, default_value=0.0),
            "ang": tf.io.FixedLenFeature((), dtype=tf.float32, default_value=0.0),
            "ecal": tf.io.FixedLenFeature((), dtype=tf.float32, default_value=0.0)}
    out = {k: [] for k in spec}
    for raw in tf.data.TFRecordDataset([path]):
        d = tf.io.parse_single_example(raw, spec)
        out["X"].append(tf.reshape(d["X"], SHAPE).numpy())
        for k in ("Y", "ang", "ecal"):
            out[k].append(tf.reshape(d[k], [1]).numpy())
    return {k: np.stack(v) for k, v in out.items()}
