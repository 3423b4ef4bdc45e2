"""train.best and early stopping with a direction (min | max), under real mpirun: the best
checkpoint survives rotation and resume, early stopping on a metric that rises."""
import json
import os

import numpy as np
import pytest
import torch

from conftest import REPO, TESTS, mpirun, train_args
from mpilearn.train.callbacks import BestCheckpoint, EarlyStopping

MLP = os.path.join(REPO, "models", "mlp.py")


def records(out):
    return [r for r in map(json.loads, open(out / "metrics.jsonl")) if "time" in r]


def train(np_, toy_file, out, *extra):
    return mpirun(np_, train_args("--set", f"model={MLP}", "--set", f"data.files=[{toy_file}]",
                                  "--set", "train.batch_size=16", "--set",
                                  "train.keep_checkpoints=1", "--output", str(out), *extra),
                  timeout=180)


@pytest.mark.parametrize("monitor,mode", [("val_mae", "min"), ("val_loss", "max")])
def test_best_checkpoint_kept_across_rotation_and_resume(toy_file, tmp_path, monitor, mode):
    out = tmp_path / "run"
    best = ["--set", f"train.best.monitor={monitor}", "--set", f"train.best.mode={mode}"]
    first = train(2, toy_file, out, "--set", "train.epochs=2", *best)
    assert first.returncode == 0, first.stderr
    # resumed: the best value of the first two epochs must still count
    second = train(2, toy_file, out, "--set", "train.epochs=4", "--resume", *best)
    assert second.returncode == 0, second.stderr
    logged = records(out)
    assert [r["epoch"] for r in logged] == [1, 2, 3, 4]
    values = [r[monitor] for r in logged]
    pick = np.argmin if mode == "min" else np.argmax
    epoch = int(pick(values)) + 1
    ckpts = sorted(p.name for p in (out / "checkpoints").glob("ckpt-*.pt"))
    assert ckpts == ["ckpt-e0004-s0000000.pt"]  # keep_checkpoints=1 rotated the others away
    state = torch.load(out / "checkpoints" / "best.pt", weights_only=True)
    assert state["epoch"] == epoch  # the position after the best epoch: resumable as is
    assert state["callbacks"]["best"]["best"] == pytest.approx(values[epoch - 1])
    info = json.load(open(out / "models" / "best" / "best.json"))
    assert (info["epoch"], info["monitor"], info["mode"]) == (epoch, monitor, mode)
    exported = torch.load(out / "models" / "best" / "model.pt", weights_only=True)
    for k, v in state["task"]["models"]["model"].items():
        assert torch.equal(exported[k], v)
    last = torch.load(out / "models" / "model.pt", weights_only=True)
    assert any(not torch.equal(last[k], v) for k, v in exported.items()) == (epoch != 4)


def test_early_stopping_on_a_metric_that_rises(tmp_path):
    """val_accuracy is maximised (its mode inferred): training goes on while it rises and
    stops after `patience` epochs without a new maximum."""
    import h5py

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    with h5py.File(tmp_path / "classes.h5", "w") as f:
        f["X"] = x
        f["label"] = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 1).astype(np.int64)
    out = tmp_path / "run"
    proc = mpirun(2, train_args("--set", f"model={TESTS}/models/classifier.py",
                                "--set", f"data.files=[{tmp_path / 'classes.h5'}]",
                                "--set", "train.epochs=30", "--set", "hparams.lr=0.3",
                                "--set", "train.early_stopping.monitor=val_accuracy",
                                "--set", "train.early_stopping.patience=3",
                                "--output", str(out)), timeout=180)
    assert proc.returncode == 0, proc.stderr
    acc = [r["val_accuracy"] for r in records(out)]
    best, bad, expected = -1.0, 0, len(acc)
    for i, a in enumerate(acc):
        best, bad = (a, 0) if a > best else (best, bad + 1)
        if bad == 3:
            expected = i + 1
            break
    assert len(acc) == expected, acc
    assert max(acc) > acc[0]  # it rose, and training went on while it did
    if expected < 30:
        assert "early stopping: val_accuracy (max)" in proc.stdout


def test_a_metric_missing_from_an_epoch_is_skipped():
    """Physics runs every N epochs only: the epochs without the metric count neither way."""
    stop = EarlyStopping("score", patience=1, min_delta=0.0, mode="min")
    track = BestCheckpoint("score", "min")
    for record, stops, improved in [({"epoch": 1, "score": 2.0}, False, True),
                                    ({"epoch": 2}, False, False),
                                    ({"epoch": 3, "score": 1.0}, False, True),
                                    ({"epoch": 4}, False, False),
                                    ({"epoch": 5, "score": 1.5}, True, False)]:
        assert stop.on_epoch_end(record) is stops
        track.on_epoch_end(record)
        assert track.improved is improved
    assert (track.best, track.epoch) == (1.0, 3)


def test_gan_best_monitor_follows_the_sampling_fraction_error():
    from mpilearn.core.config import resolve
    from mpilearn.models.gan3d import build
    from mpilearn.train.checks import check_monitor

    task = build({"preset": "small"})
    config = resolve(None, ["model=mpilearn.models.gan3d", "train.validate_every=2"])
    assert check_monitor(config, task, True)["best"] == ("sampling_fraction_mre", "min")
    config["train"]["validate_every"] = 0  # no physics: no val_loss either, so no best
    assert check_monitor(config, task, True)["best"] is None
