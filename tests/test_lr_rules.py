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


def _whole_and_resumed(toy_files, tmp_path, stop_after, *extra):
    """Three epochs at np=2 in one run ("whole"), and stopped after ``stop_after`` epochs then
    resumed to three ("cut"); the two run directories."""
    whole = _run(2, toy_files, tmp_path / "whole", 16, *extra, "--set", "train.epochs=3")
    assert whole.returncode == 0, whole.stderr
    cut = tmp_path / "cut"
    first = _run(2, toy_files, cut, 16, *extra, "--set", f"train.epochs={stop_after}")
    assert first.returncode == 0, first.stderr
    rest = _run(2, toy_files, cut, 16, *extra, "--set", "train.epochs=3", "--resume")
    assert rest.returncode == 0, rest.stderr
    return tmp_path / "whole", cut


def test_warmup_survives_a_resume_exactly(toy_files, tmp_path):
    # a 3-epoch warm-up: the run stops after epoch 1 mid-ramp and resumes for two more
    whole, cut = _whole_and_resumed(toy_files, tmp_path, 1, "--set", "train.lr_scaling=linear",
                                    "--set", "train.warmup_epochs=3")
    lrs = _lrs(whole)
    # step 6k+5 (the epoch's last) of 18 warm-up steps: 1 + (2 - 1) x (6k + 6) / 18
    assert lrs == pytest.approx([0.01 * (1 + 6 / 18), 0.01 * (1 + 12 / 18), 0.02])
    assert _lrs(cut) == lrs
    wa, wb = _weights(whole), _weights(cut)
    for k in wa:
        assert np.array_equal(wa[k].numpy(), wb[k].numpy()), k


def test_the_epoch_record_names_each_optimizers_rate_where_they_differ():
    from mpilearn.train.scaling import Scaling

    scaling = Scaling.__new__(Scaling)  # the record's lr fields only: no run needed
    scaling.lr, scaling.lrs = 0.002, {"generator": 0.002, "discriminator": 0.002}
    assert scaling.lr_fields() == {"lr": 0.002}
    scaling.lrs = {"generator": 0.002, "discriminator": 0.0005}
    assert scaling.lr_fields() == {"lr": 0.002, "lr_generator": 0.002,
                                   "lr_discriminator": 0.0005}


def test_the_end_line_counts_ranks_only_where_the_estimate_can_bear_it():
    from mpilearn.train.scaling import advice

    est = {"critical_batch": 40.0, "critical_batch_err": 4.0, "preconditioned": True,
           "efficiency": 0.385, "global_batch": 64, "steps": 128}
    assert advice("D", est, 16, 4).endswith("at 16 per rank, ranks beyond 2 cost events, not time")
    assert advice("D", est, 8, 4).endswith("up to about 5 ranks save time")
    assert "(preconditioned, data efficiency 38% at global batch 64)" in advice("D", est, 16, 4)
    # G's 32 ± 930 of a run measured here: no rank count may be read off that
    noisy = dict(est, critical_batch=32.0, critical_batch_err=930.0)
    line = advice("G", noisy, 16, 2)
    assert "32 ± 9.3e+02" in line and "too uncertain" in line and "ranks beyond" not in line
    assert "beyond measure" in advice("G", dict(est, critical_batch=None), 16, 2)


def test_auto_gives_each_optimizer_its_own_rule():
    import keras
    import torch

    from mpilearn.train.scaling import Scaling

    class Two:  # what the engine reads of a task: its optimizers and their rates
        def __init__(self, opts):
            self.opts = opts

        def optimizers(self):
            return self.opts

        def learning_rates(self):
            return {k: [0.1] for k in self.opts}

        def set_learning_rates(self, lrs):  # the torch ones (the srsr case)
            for k, o in self.opts.items():
                o.param_groups[0]["lr"] = lrs[k][0]

    p = [torch.nn.Parameter(torch.zeros(2))]
    adaptive = {"rmsprop": torch.optim.RMSprop(p), "adam": torch.optim.Adam(p),
                "adamw": torch.optim.AdamW(p), "adagrad": torch.optim.Adagrad(p),
                "k_rmsprop": keras.optimizers.RMSprop(), "k_adam": keras.optimizers.Adam()}
    plain = {"sgd": torch.optim.SGD(p, lr=0.1, momentum=0.9), "k_sgd": keras.optimizers.SGD()}
    train = {"lr_scaling": "auto", "base_batch": 0, "batch_size": 16, "warmup_epochs": 0}
    s = Scaling(train, Two({**adaptive, **plain}))
    assert s.rules == {**{k: "sqrt" for k in adaptive}, **{k: "linear" for k in plain}}
    # the first epoch's line names each rule and why; linear on an adaptive one warns once
    head = s.describe(4, 16)[0]
    assert "rmsprop (RMSprop, adaptive): sqrt x2" in head and "sgd (SGD, not adaptive): linear x4" in head
    warned = Scaling(dict(train, lr_scaling="linear"), Two(adaptive)).describe(4, 16)[1:]
    assert len(warned) == len(adaptive) and all("warning" in w for w in warned)
    # srsr: lr x sqrt(k), each 1 - beta x k, eps / sqrt(k); SGD keeps the linear rule
    s = Scaling(dict(train, lr_scaling="srsr"), Two({"adam": torch.optim.Adam(p, lr=0.1),
                                                     "sgd": torch.optim.SGD(p, lr=0.1)}))
    assert s.rules == {"adam": "srsr", "sgd": "linear"}
    s.set_lr(4, 16, 10, 5)
    g = s.task.opts["adam"].param_groups[0]
    assert g["lr"] == pytest.approx(0.2) and s.task.opts["sgd"].param_groups[0]["lr"] == pytest.approx(0.4)
    assert g["betas"] == pytest.approx((1 - 4 * 0.1, 1 - 4 * 0.001)) and g["eps"] == pytest.approx(0.5e-8)


def test_srsr_past_its_bound_is_refused_before_training(toy_files, tmp_path):
    # Adam's beta1 0.9 at k = 64 (base batch 1, 2 x 32): 64 x (1 - beta1) = 6.4 > 0.5
    proc = _run(2, toy_files, tmp_path / "srsr", 32, "--set", "hparams.optimizer=adam",
                "--set", "train.lr_scaling=srsr", "--set", "train.base_batch=1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if "srsr" in ln]
    assert len(errors) == 1, proc.stderr  # one line, from rank 0
    assert "k = 64" in errors[0] and "beta1" in errors[0] and "0.5" in errors[0]
    assert not (tmp_path / "srsr" / "metrics.jsonl").exists()


def test_gain_follows_the_noise_scale_and_resumes_exactly(toy_files, tmp_path):
    whole, cut = _whole_and_resumed(toy_files, tmp_path, 2, "--set", "train.lr_scaling=gain",
                                    "--set", "train.max_steps_per_epoch=12")
    records = [json.loads(line) for line in open(whole / "metrics.jsonl")]
    # epoch 1 at the configured rate (nothing measured yet), then x gain (SGD: linear in it)
    gains = [r["noise_scale"]["optimizer"]["gain"] for r in records]
    assert records[0]["lr"] == pytest.approx(0.01)
    assert all(1.0 < g < 2.0 for g in gains)  # between no gain and k = 2
    assert records[1]["lr"] == pytest.approx(0.01 * gains[0])
    assert _lrs(cut) == pytest.approx(_lrs(whole), rel=1e-12)
    wa, wb = _weights(whole), _weights(cut)
    for k in wa:
        np.testing.assert_allclose(wb[k].numpy(), wa[k].numpy(), rtol=1e-12, atol=1e-14)
