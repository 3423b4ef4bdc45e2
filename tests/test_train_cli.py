"""The training CLI end to end: engine-level equivalence, outputs, bad input."""
import json
import os

import numpy as np
import pytest
import yaml

from conftest import REPO, TESTS, mpirun, train_args
from mpilearn.train import checkpoint as ckpt

MLP = os.path.join(REPO, "models", "mlp.py")


def run(np_, toy_files, out, *extra):
    return mpirun(np_, train_args("--set", f"model={MLP}", "--set", f"data.files={toy_files!r}".replace("'", ""),
                                  "--set", "hparams.optimizer=sgd", "--set", "hparams.momentum=0.9",
                                  "--output", str(out), *extra))


def test_two_ranks_equal_one_rank_with_double_batch_through_engine(toy_files, tmp_path):
    # the lr was tuned at the global batch of 32 (base_batch): no rule rescales it on either
    tuned = ("--set", "train.base_batch=32", "--set", "train.epochs=2")
    a = run(1, toy_files, tmp_path / "a", "--set", "train.batch_size=32", *tuned)
    b = run(2, toy_files, tmp_path / "b", "--set", "train.batch_size=16", *tuned)
    assert a.returncode == 0, a.stderr
    assert b.returncode == 0, b.stderr
    wa = ckpt.load(ckpt.latest(str(tmp_path / "a" / "checkpoints")))["task"]["models"]["model"]
    wb = ckpt.load(ckpt.latest(str(tmp_path / "b" / "checkpoints")))["task"]["models"]["model"]
    for k in wa:
        np.testing.assert_allclose(wb[k].numpy(), wa[k].numpy(), rtol=1e-5, atol=1e-6)
    ma = [json.loads(l) for l in open(tmp_path / "a" / "metrics.jsonl")]
    mb = [json.loads(l) for l in open(tmp_path / "b" / "metrics.jsonl")]
    assert [m["epoch"] for m in mb] == [1, 2]
    assert mb[-1]["val_loss"] == pytest.approx(ma[-1]["val_loss"], rel=1e-4)
    assert mb[-1]["val_loss"] < mb[0]["val_loss"] * 1.5  # trains, not diverges


@pytest.mark.smoke  # make check: the np=2 run of train
def test_run_directory_contents(toy_files, tmp_path):
    out = tmp_path / "run"
    proc = run(2, toy_files, out, "--set", "train.epochs=2", "--set", "train.lr_scaling=linear",
               "--set", "train.warmup_epochs=1")
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load(open(out / "config.yaml"))
    assert config["train"]["epochs"] == 2 and config["model"] == MLP
    assert config["output"] == str(out)  # where the run went, also when --output said it
    lines = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert len(lines) == 2
    for rec in lines:
        assert {"train_loss", "val_loss", "val_mae", "samples_per_s", "time", "time_per_rank"} <= set(rec)
        assert len(rec["time_per_rank"]) == 2
        assert set(rec["time"]) == {"compute", "allreduce", "data", "seconds"}
    # linear scaling: lr reaches 2 x base after the warm-up epoch
    assert lines[1]["lr"] == pytest.approx(2 * 0.01)
    assert lines[0]["lr"] == pytest.approx(2 * 0.01)  # last step of the warm-up epoch
    assert os.path.exists(out / "checkpoints" / "latest")
    # the checkpoint and the exports are plain PyTorch: tensors and plain types only
    import torch
    from safetensors.torch import load_file

    final = torch.load(ckpt.latest(str(out / "checkpoints")), weights_only=True)
    exported = torch.load(out / "models" / "model.pt", weights_only=True)
    assert set(exported) == set(final["task"]["models"]["model"])
    for k, v in load_file(str(out / "models" / "model.safetensors")).items():
        assert torch.equal(v, exported[k]) and torch.equal(v, final["task"]["models"]["model"][k])
    # one progress line per epoch, from rank 0 only
    assert proc.stdout.count("epoch 1:") == 1


def test_early_stopping(toy_files, tmp_path):
    out = tmp_path / "run"
    proc = run(1, toy_files, out, "--set", "train.epochs=20", "--set", "hparams.lr=0.0",
               "--set", "train.early_stopping.patience=2")
    assert proc.returncode == 0, proc.stderr
    assert "early stopping" in proc.stdout
    assert len(open(out / "metrics.jsonl").read().splitlines()) == 3


BAD = [
    (["--set", "model=models/nothere.py"], "model file not found: models/nothere.py"),
    (["--set", f"model={TESTS}/models/nobuilder.py"], "no builder function 'build(hparams)'"),
    (["--set", "train.epochs=two"], "'train.epochs' must be an integer"),
    (["--set", "train.epocs=2"], "unknown config key 'train.epocs'; did you mean 'train.epochs'?"),
    (["--set", "data.files=[/nonexistent/data.h5]"], "data file not found: /nonexistent/data.h5"),
    (["--set", "train.backend=gloo"], "'train.backend' is 'gloo'"),
]


@pytest.mark.parametrize("extra,message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_input_one_message_status_2(toy_files, tmp_path, extra, message):
    out = tmp_path / "run"
    proc = run(2, toy_files, out, *extra)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert proc.stderr.count("mpilearn: error:") == 1
    assert "Traceback" not in proc.stderr
    assert not (out / "metrics.jsonl").exists()  # before training started


def test_missing_hdf5_key(tmp_path):
    import h5py

    path = tmp_path / "nokey.h5"
    with h5py.File(path, "w") as f:
        f["X"] = np.zeros((10, 8), np.float32)
    proc = mpirun(2, train_args("--set", f"model={MLP}", "--set", f"data.files=[{path}]",
                                "--output", str(tmp_path / "run")))
    assert proc.returncode == 2
    assert f"{path}: no dataset 'y'" in proc.stderr
    assert proc.stderr.count("mpilearn: error:") == 1


def test_config_file_and_help(toy_files, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": MLP, "data": {"files": toy_files},
                                   "train": {"epochs": 1, "batch_size": 16}}))
    proc = mpirun(1, train_args("--config", str(cfg), "--output", str(tmp_path / "r")))
    assert proc.returncode == 0, proc.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2]\n")
    proc = mpirun(1, train_args("--config", str(bad)))
    assert proc.returncode == 2 and "'train' must be a mapping" in proc.stderr
    proc = mpirun(1, ["-m", "mpilearn.train", "--help"])
    assert proc.returncode == 0 and "train.backend" in proc.stdout


def test_max_steps_per_epoch_caps_validation_too(toy_files, tmp_path):
    common = ("--set", "train.batch_size=16", "--set", "data.val_fraction=0.1")
    capped = run(2, toy_files, tmp_path / "capped", *common, "--set", "train.max_steps_per_epoch=2")
    full = run(2, toy_files, tmp_path / "full", *common)
    assert capped.returncode == 0, capped.stderr
    assert full.returncode == 0, full.stderr
    capped_rec = [json.loads(l) for l in open(tmp_path / "capped" / "metrics.jsonl")][-1]
    full_rec = [json.loads(l) for l in open(tmp_path / "full" / "metrics.jsonl")][-1]
    assert capped_rec["val_events"] == 2 * 16 * 2  # 2 batches of 16 on each of 2 ranks
    assert full_rec["val_events"] == round(0.1 * 1024)  # every validation event


def test_an_earlier_run_is_never_silently_overwritten(toy_files, tmp_path):
    out = tmp_path / "run"
    first = run(1, toy_files, out, "--set", "train.epochs=1")
    assert first.returncode == 0, first.stderr
    before = (out / "metrics.jsonl").read_text()
    again = run(1, toy_files, out, "--set", "train.epochs=1")
    assert again.returncode == 2 and "already holds a run" in again.stderr
    assert "--resume" in again.stderr and "--overwrite" in again.stderr
    assert (out / "metrics.jsonl").read_text() == before  # untouched
    changed = run(1, toy_files, out, "--set", "train.epochs=2", "--set", "hparams.lr=0.02",
                  "--resume")
    assert changed.returncode == 2, changed.stderr
    assert "hparams.lr: (unset) -> 0.02" in changed.stderr and "--force" in changed.stderr
    assert (out / "metrics.jsonl").read_text() == before
    # a run written before a key existed (train.noise_scale): it had its default then
    saved = yaml.safe_load(open(out / "config.yaml"))
    del saved["train"]["noise_scale"]
    (out / "config.yaml").write_text(yaml.safe_dump(saved))
    longer = run(1, toy_files, out, "--set", "train.epochs=2", "--resume")  # a safe change
    assert longer.returncode == 0, longer.stderr
    assert "resuming with a changed config: train.epochs: 1 -> 2\n" in longer.stdout
    assert [json.loads(l)["epoch"] for l in open(out / "metrics.jsonl")] == [1, 2]
    forced = run(1, toy_files, out, "--set", "train.epochs=3", "--set", "hparams.lr=0.02",
                 "--resume", "--force")
    assert forced.returncode == 0, forced.stderr
    assert yaml.safe_load(open(out / "config.yaml"))["hparams"]["lr"] == 0.02
    fresh = run(1, toy_files, out, "--set", "train.epochs=1", "--overwrite")
    assert fresh.returncode == 0, fresh.stderr
    assert [json.loads(l)["epoch"] for l in open(out / "metrics.jsonl")] == [1]
    # one checkpoint, 'latest' and the best epoch's (train.best: val_loss by default)
    assert sorted(os.listdir(out / "checkpoints")) == ["best.pt", "ckpt-e0001-s0000000.pt",
                                                       "latest"]


def test_tensorboard_and_csv_logs(toy_files, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    proc = run(2, toy_files, out, "--set", "train.epochs=2", "--set", "train.log=[jsonl,tensorboard,csv]",
               "--set", "train.log_every_steps=5")
    assert proc.returncode == 0, proc.stderr
    jsonl = [json.loads(l) for l in open(out / "metrics.jsonl")]
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"epoch/train_loss", "epoch/val_loss", "epoch/time.compute", "step/train_loss"} <= tags
    val = events.Scalars("epoch/val_loss")
    assert [e.step for e in val] == [r["step"] for r in jsonl]
    assert [e.value for e in val] == pytest.approx([r["val_loss"] for r in jsonl], rel=1e-6)
    assert [e.step for e in events.Scalars("step/train_loss")] == list(range(5, jsonl[-1]["step"] + 1, 5))
    import csv

    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert [int(r["epoch"]) for r in rows] == [1, 2]
    assert float(rows[1]["val_loss"]) == pytest.approx(jsonl[1]["val_loss"])
    bad = run(1, toy_files, tmp_path / "bad", "--set", "train.log=[jsonl,tensorbord]")
    assert bad.returncode == 2 and "train.log has 'tensorbord'" in bad.stderr


def test_integer_targets_and_unknown_hparams(tmp_path):
    import h5py

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    with h5py.File(tmp_path / "classes.h5", "w") as f:
        f["X"] = x
        f["label"] = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 1).astype(np.int64)
    model = os.path.join(TESTS, "models", "classifier.py")
    args = ["--set", f"model={model}", "--set", f"data.files=[{tmp_path / 'classes.h5'}]"]
    proc = mpirun(2, train_args(*args, "--set", "train.epochs=20", "--set", "hparams.lr=0.3",
                                "--output", str(tmp_path / "run")))
    assert proc.returncode == 0, proc.stderr  # class indices stay integer for CrossEntropyLoss
    last = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")][-1]
    assert last["val_accuracy"] > 0.5
    typo = mpirun(2, train_args(*args, "--set", "hparams.classses=4", "--output", str(tmp_path / "t")))
    assert typo.returncode == 2, typo.stderr
    assert "hparams.classses: the model" in typo.stderr and "did you mean 'classes'" in typo.stderr
    assert typo.stderr.count("mpilearn: error:") == 1 and not (tmp_path / "t").exists()


def test_without_a_config_the_documented_defaults_apply(toy_files, tmp_path):
    """The demo job is a base only with --demo: a plain run gets the key table's defaults."""
    proc = mpirun(1, train_args("--set", f"model={MLP}", "--set",
                                f"data.files={toy_files!r}".replace("'", ""),
                                "--output", str(tmp_path / "plain")))
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load(open(tmp_path / "plain" / "config.yaml"))
    assert config["hparams"] == {} and config["data"]["val_fraction"] == 0.1
    assert (config["train"]["epochs"], config["train"]["batch_size"]) == (1, 32)
    assert config["train"]["validate_every"] == 0
    assert [json.loads(l)["epoch"] for l in open(tmp_path / "plain" / "metrics.jsonl")] == [1]
    nothing = mpirun(1, train_args("--output", str(tmp_path / "none")))
    assert nothing.returncode == 2 and "no model given" in nothing.stderr
    assert "--demo" in nothing.stderr
