"""Large-batch learning-rate rules (mpilearn.train.lr_rules): the documented rate at given steps,
exact across a resume, and N ranks x batch b == 1 rank x batch N*b under each rule."""
import json
import math

import numpy as np
import pytest

from conftest import TESTS, mpirun, train_args
from mpilearn.train import checkpoint as ckpt
from mpilearn.train.lr_rules import factor, from_config

MODEL = f"{TESTS}/models/slow64.py"  # the MLP example in float64


def test_rules_give_the_documented_rate():
    # base batch 32, global 128: linear x4, sqrt x2, none x1
    assert factor("linear", 128, 32, 0, 0) == 4.0
    assert factor("sqrt", 128, 32, 0, 0) == 2.0
    assert factor("none", 128, 32, 0, 0) == 1.0
    # a 10-step warm-up ramps linearly from the configured rate, step (0-based) 4 is half-way
    assert factor("linear", 128, 32, 10, 4) == pytest.approx(2.5)
    assert factor("sqrt", 128, 32, 10, 4) == pytest.approx(1.5)
    assert factor("linear", 128, 32, 10, 9) == 4.0 and factor("linear", 128, 32, 10, 99) == 4.0
    assert factor("linear", 128, 32, 10, 0) == pytest.approx(1.3)
    # a global batch below the base scales down at once: nothing to warm up
    assert factor("sqrt", 8, 32, 10, 0) == 0.5 and factor("linear", 8, 32, 10, 5) == 0.25
    # base_batch 0 = the per-rank batch: linear is lr x ranks, as before
    train = {"lr_scaling": "linear", "base_batch": 0, "batch_size": 16, "warmup_epochs": 0}
    assert from_config(train, 4, 10, 0) == 4.0
    train.update(lr_scaling="sqrt", base_batch=16, warmup_epochs=0.5)  # 5 warm-up steps
    assert from_config(train, 4, 10, 1) == pytest.approx(1 + (2 - 1) * 2 / 5)
    assert from_config(train, 4, 10, 4) == pytest.approx(math.sqrt(4))


def _run(np_, toy_files, out, batch, *extra):
    files = "[" + ",".join(toy_files) + "]"
    return mpirun(np_, train_args("--set", f"model={MODEL}", "--set", f"data.files={files}",
                                  "--set", "hparams.sleep=0", "--set", "hparams.optimizer=sgd",
                                  "--set", "hparams.momentum=0.9", "--set", "data.shuffle=false",
                                  "--set", f"train.batch_size={batch}", "--set", "train.base_batch=16",
                                  "--set", "train.max_steps_per_epoch=6", "--output", str(out), *extra))


def _weights(out):
    return ckpt.load(ckpt.latest(str(out / "checkpoints")))["task"]["models"]["model"]


def _lrs(out):
    return [json.loads(line)["lr"] for line in open(out / "metrics.jsonl")]


@pytest.mark.parametrize("rule", ["none", "linear", "sqrt"])
def test_two_ranks_equal_one_rank_with_double_batch_under_each_rule(toy_files, tmp_path, rule):
    extra = ("--set", f"train.lr_scaling={rule}", "--set", "train.warmup_epochs=1",
             "--set", "train.epochs=2")
    a = _run(1, toy_files, tmp_path / "a", 32, *extra)
    b = _run(2, toy_files, tmp_path / "b", 16, *extra)
    assert a.returncode == 0, a.stderr
    assert b.returncode == 0, b.stderr
    # global batch 32 on base 16: x2 (linear) or x sqrt 2, reached at the warm-up's last step
    want = {"none": 0.01, "linear": 0.02, "sqrt": 0.01 * math.sqrt(2)}[rule]
    assert _lrs(tmp_path / "a") == pytest.approx([want, want])
    assert _lrs(tmp_path / "b") == pytest.approx([want, want])
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    for k in wa:
        np.testing.assert_allclose(wb[k].numpy(), wa[k].numpy(), rtol=1e-12, atol=1e-14)


def test_warmup_survives_a_resume_exactly(toy_files, tmp_path):
    # a 3-epoch warm-up: the run stops after epoch 1 mid-ramp and resumes for two more
    extra = ("--set", "train.lr_scaling=linear", "--set", "train.warmup_epochs=3")
    whole = _run(2, toy_files, tmp_path / "whole", 16, *extra, "--set", "train.epochs=3")
    assert whole.returncode == 0, whole.stderr
    cut = tmp_path / "cut"
    first = _run(2, toy_files, cut, 16, *extra, "--set", "train.epochs=1")
    assert first.returncode == 0, first.stderr
    rest = _run(2, toy_files, cut, 16, *extra, "--set", "train.epochs=3", "--resume")
    assert rest.returncode == 0, rest.stderr
    lrs = _lrs(tmp_path / "whole")
    # step 6k+5 (the epoch's last) of 18 warm-up steps: 1 + (2 - 1) x (6k + 6) / 18
    assert lrs == pytest.approx([0.01 * (1 + 6 / 18), 0.01 * (1 + 12 / 18), 0.02])
    assert _lrs(cut) == lrs
    wa, wb = _weights(tmp_path / "whole"), _weights(cut)
    for k in wa:
        assert np.array_equal(wa[k].numpy(), wb[k].numpy()), k


def test_the_epoch_record_names_each_optimizers_rate_where_they_differ():
    from mpilearn.train.engine import Trainer

    trainer = Trainer.__new__(Trainer)  # the record's lr fields only: no run needed
    trainer.lr, trainer.lrs = 0.002, {"generator": 0.002, "discriminator": 0.002}
    assert trainer._lr_fields() == {"lr": 0.002}
    trainer.lrs = {"generator": 0.002, "discriminator": 0.0005}
    assert trainer._lr_fields() == {"lr": 0.002, "lr_generator": 0.002,
                                    "lr_discriminator": 0.0005}
