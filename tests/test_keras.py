"""Keras 3: through mpilearn.keras N ranks x batch b equal 1 rank x batch N*b, in a custom
loop and under model.fit(), on the TensorFlow and the torch backends; through the engine
the same, plus kill -9 and resume, and abort on a crash."""
import json
import os
import sys

import numpy as np
import pytest

from conftest import REPO, TESTS, kill9_after_mid_epoch_checkpoint, mpirun, train_args
from mpilearn.core.io import read_jsonl
from mpilearn.train import checkpoint as ckpt

SCRIPT = f"{TESTS}/scripts/keras_equivalence.py"


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
@pytest.mark.parametrize("mode", ["loop", "fit"])
def test_two_ranks_equal_one_rank_with_double_batch(backend, mode, tmp_path):
    env = {"KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"}
    one, two = str(tmp_path / "one.npz"), str(tmp_path / "two.npz")
    p1 = mpirun(1, [SCRIPT, mode, "8", "6", one], env=env)
    assert p1.returncode == 0, p1.stderr
    p2 = mpirun(2, [SCRIPT, mode, "4", "6", two], env=env)
    assert p2.returncode == 0, p2.stderr
    a, b = np.load(one), np.load(two)
    assert len(a.files) == 4
    for k in a.files:
        np.testing.assert_allclose(b[k], a[k], rtol=2e-5, atol=2e-6)


def keras_args(toy_file, out, model="keras_mlp.py", *sets):
    folder = REPO + "/models" if model == "keras_mlp.py" else TESTS + "/models"
    extra = [x for s in sets for x in ("--set", s)]
    return train_args("--set", f"model={folder}/{model}", "--set", f"data.files=[{toy_file}]",
                      "--set", "train.batch_size=16", *extra, "--output", out)


def final_weights(out):
    state = ckpt.load(ckpt.latest(os.path.join(out, "checkpoints")))
    return state["epoch"], state["task"]["models"]["model"]


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_engine_trains_a_keras_model_file_like_a_torch_one(backend, toy_file, tmp_path):
    env = {"KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"}
    tuned = "train.base_batch=32"  # the lr was tuned at the global batch: no rule rescales it
    one = mpirun(1, keras_args(toy_file, str(tmp_path / "one"), "keras_mlp.py",
                               "train.epochs=2", "train.batch_size=32", tuned), env=env)
    assert one.returncode == 0, one.stderr
    two = mpirun(2, keras_args(toy_file, str(tmp_path / "two"), "keras_mlp.py", "train.epochs=2",
                               tuned), env=env)
    assert two.returncode == 0, two.stderr
    (e1, w1), (e2, w2) = final_weights(str(tmp_path / "one")), final_weights(str(tmp_path / "two"))
    assert e1 == e2 == 2
    for a, b in zip(w1, w2):  # 2 ranks x 16 = 1 rank x 32 through the whole engine
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    records = read_jsonl(str(tmp_path / "two" / "metrics.jsonl"))
    assert [r["epoch"] for r in records] == [1, 2] and records[-1]["val_loss"] < records[0]["val_loss"] * 1.5
    import keras  # the exported model loads back

    model = keras.models.load_model(str(tmp_path / "two" / "models" / "model.keras"))
    assert model.count_params() == sum(np.asarray(w).size for w in w2)


def test_keras_kill9_then_resume_matches_uninterrupted(toy_file, tmp_path):
    env = {"TF_CPP_MIN_LOG_LEVEL": "2"}
    sets = ["train.epochs=3", "train.checkpoint_every_steps=4", "hparams.sleep=0.03"]
    whole = str(tmp_path / "whole")
    proc = mpirun(2, keras_args(toy_file, whole, "keras_slow.py", *sets), env=env)
    assert proc.returncode == 0, proc.stderr
    cut = str(tmp_path / "cut")
    kill9_after_mid_epoch_checkpoint(2, keras_args(toy_file, cut, "keras_slow.py", *sets), cut, env)
    proc = mpirun(2, keras_args(toy_file, cut, "keras_slow.py", *sets) + ["--resume"], env=env)
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr
    (e1, got), (e2, want) = final_weights(cut), final_weights(whole)
    assert e1 == e2 == 3
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_a_keras_crash_on_one_rank_aborts_the_job(toy_file, tmp_path):
    crash = tmp_path / "crash.py"
    crash.write_text(
        "import sys\nsys.path.insert(0, %r)\nimport keras_mlp\nimport mpilearn\n"
        "from mpilearn.train.keras_tasks import as_task\n"
        "def build(hp):\n    task = as_task(keras_mlp.build(hp))\n    step = task.train_step\n"
        "    def boom(batch):\n        if mpilearn.rank() == 1:\n"
        "            raise RuntimeError('deliberate keras failure')\n        return step(batch)\n"
        "    task.train_step = boom\n    return task\n" % (REPO + "/models"))
    proc = mpirun(2, train_args("--set", f"model={crash}", "--set", f"data.files=[{toy_file}]",
                                "--output", str(tmp_path / "out")), timeout=120,
                  env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode != 0 and "rank 1: RuntimeError: deliberate keras failure" in proc.stderr


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_3dgan_keras_matches_pytorch_after_copying_the_weights(backend, tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "parity.json"
    proc = subprocess.run([sys.executable, f"{TESTS}/scripts/keras_parity.py", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    # the reference's trainable counts (3dgan.md §1a, §1b)
    assert result["angle-full"]["keras_trainable"] == [1364983, 87354]
    assert result["fixed-full"]["keras_trainable"] == [872808, 73402]
    # the discriminators agree on empty, faint and normal showers, the empty one at 100
    for shower in ("empty", "faint", "normal"):
        r = result.pop(f"d_on_{shower}")
        assert max(r["max_abs_err"]) <= 1e-3, (shower, r)
        if shower == "empty":
            assert r["torch_angle"] == r["keras_angle"] == [100.0, 100.0]
        else:
            assert 100.0 not in r["torch_angle"] + r["keras_angle"], (shower, r)
    # the reference RMSprop (eps outside the square root) follows torch's for 5 updates;
    # Keras 3's own (eps inside) does not
    assert max(result.pop("rmsprop_reference_max_err")) <= 1e-5
    assert max(result.pop("rmsprop_keras3_max_err")) > 1e-2
    for name, r in result.items():
        assert r["keras_trainable"] == r["torch_trainable"], name
        assert r["g_rel_err"] <= 1e-4 and max(r["d_rel_err"]) <= 1e-4, (name, r)
        assert len(r["d_rel_err"]) == (3 if name.startswith("fixed") else 4)


def test_the_3dgan_twins_take_the_same_training_step_from_the_same_weights(tmp_path):
    """One step of the four updates (float64, batch norm on) in models/gan3d.py and its Keras
    twin from copied weights: the losses agree to the float32 rounding of the shared draws, and
    the weights move alike (RMSprop's first step is lr x sqrt(10) x the gradient's sign, so a
    weight whose gradient is near zero may step either way; a missing or different update
    moves by its whole size)."""
    import subprocess
    import sys

    out = tmp_path / "step.json"
    proc = subprocess.run([sys.executable, f"{TESTS}/scripts/keras_twin_step.py", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KERAS_BACKEND": "torch", "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["moved"] > 1e-3, r
    assert r["rel_diff"] <= 0.02, r
    for key, value in r["losses"]["torch"].items():
        assert r["losses"]["keras"][key] == pytest.approx(value, rel=1e-5), key


def test_keras_3dgan_trains_through_the_engine(tmp_path):
    from mpilearn.calo.simulate import simulate

    simulate(str(tmp_path / "showers"), 64, "angle", (100, 200), 1, 64, progress=False)
    out = tmp_path / "gan"
    proc = mpirun(2, train_args("--set", f"model={REPO}/models/gan3d_keras.py", "--set", "hparams.preset=small",
                                "--set", f"data.files=[{tmp_path}/showers/*.h5]", "--set", "train.batch_size=8",
                                "--set", "train.max_steps_per_epoch=2", "--set", "train.validate_every=1",
                                "--set", "train.physics_events=32", "--output", str(out)),
                  env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr
    record = read_jsonl(str(out / "metrics.jsonl"))[-1]
    for key in ("train_d_loss", "train_g_loss", "train_g_angle", "val_g_loss", "score"):
        assert np.isfinite(record[key]), key
    assert (out / "models" / "generator.keras").exists() and (out / "models" / "discriminator.keras").exists()


def test_learning_rate_warmup_reaches_lr_times_ranks():
    import json

    proc = mpirun(2, [f"{TESTS}/scripts/keras_warmup.py"], env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(seen, [0.0125, 0.015, 0.0175, 0.02], rtol=1e-6)


@pytest.mark.parametrize("variant,tolerance", [("angle", 1e-4), ("fixed", 5e-2)])
def test_compiled_keras_3dgan_step_equals_the_eager_one_and_stops_on_nan(variant, tolerance,
                                                                         tmp_path):
    """On TensorFlow the four updates run as one tf.function with the allreduce inside: at
    np=2 it moves the weights as the eager updates do, and a NaN batch stops it before the
    discriminator's weights change. Stated tolerance, for the losses and relative to the
    largest move for the weights: 1e-4 for
    the angle model (measured 1e-6); 5e-2 for the 25x25x25 one (measured 1.3e-2), whose conv
    biases right before batch norm have a true gradient of zero and move by rounding noise
    alone, rounded differently by the compiled kernels. A rank whose gradients were not
    averaged moves by a different half batch: a difference of order 1."""
    import json

    out = tmp_path / "compiled.json"
    proc = mpirun(2, [f"{TESTS}/scripts/keras_compiled_step.py", variant, str(out)], timeout=300,
                  env={"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2",
                       "PYTHONPATH": REPO})  # this checkout's mpilearn, not the installed one
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["traced"] and r["max_rel_diff"] <= tolerance, r
    for fast, slow in zip(r["compiled_losses"], r["eager_losses"]):
        for k, v in slow.items():
            assert abs(fast[k] - v) <= tolerance * max(1.0, abs(v)), (k, fast[k], v)
    assert r["nan_stopped"] and "non-finite gradients, step skipped" in r["nan_stopped"]
    assert r["d_unchanged_after_nan"]


def test_keras_3dgan_tapes_equal_the_fused_path_in_float64(tmp_path):
    """The four DistributedGradientTapes against the optimizer-fused reduction at np=1 and 2,
    and on a block sub-communicator with a rank that has no events (one process per rank
    for all of it: TensorFlow's start-up dominates)."""
    out = tmp_path / "tapes.json"
    proc = mpirun(2, [f"{TESTS}/scripts/keras_gan_tapes.py", str(out)], timeout=900,
                  env={"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.load(open(out))
    assert r["tapes_on"] and r["tape_opt_plain"] and r["fused_is_distributed_optimizer"], r
    assert r["moved"] > 1e-3 and r["ranks_agree"], r
    # the same reduction, only done by the tapes: equal to float64 rounding (bitwise here)
    assert r["np2_tape_vs_fused"] <= 1e-12 and r["np1_tape_vs_fused"] <= 1e-12, r
    # another split of the same global batch: equal up to summation order
    assert r["tape_np2_vs_np1"] <= 1e-9, r
    assert r["block_with_zero_event_rank_vs_np1"] <= 1e-9, r
    for tape, fused in zip(*r["losses_np2"]):
        assert tape == pytest.approx(fused, rel=1e-12), (tape, fused)


def test_keras_seeding_on_torch_equals_keras_own_and_leaves_tensorflow_unimported():
    import subprocess
    import sys

    script = (
        "import sys, keras, numpy as np\n"
        "from mpilearn.train.setup import seed_keras\n"
        "def weights():\n"
        "    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dropout(0.5)])\n"
        "    return [np.asarray(w) for w in model.get_weights()] + [np.asarray(keras.random.normal((2,)))]\n"
        "seed_keras(7); ours = weights()\n"
        "assert 'tensorflow' not in sys.modules, 'seed_keras imported TensorFlow'\n"
        "keras.utils.set_random_seed(7); theirs = weights()\n"
        "keras.utils.set_random_seed(8); other = weights()\n"
        "assert all(np.array_equal(a, b) for a, b in zip(ours, theirs)), 'not keras own seeding'\n"
        "assert not np.array_equal(ours[0], other[0])\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KERAS_BACKEND": "torch", "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr


SNAPSHOT_CHECK = """
import keras, torch
from mpilearn.train.elastic import _copy_into
from mpilearn.train.keras_tasks import KerasSupervisedTask

model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32), keras.layers.Dense(1)])
opt = keras.optimizers.Adam(1e-3)
opt.build(model.trainable_variables)
task = KerasSupervisedTask(model, "mse", opt)
first, second = task.state_dict(), task.state_dict()
# no copy: two reads with no write between are the same memory, as torch's state_dict is
def kernel(state):
    return next(iter(state["models"].values()))[0]


same = [a.data_ptr() == b.data_ptr() for part in ("models", "optimizers")
        for name in first[part] for a, b in zip(first[part][name], second[part][name])]
saved = _copy_into(None, task.state_dict())  # the snapshot: the one copy
before = kernel(saved).clone()
model.trainable_variables[0].assign(model.trainable_variables[0] + 1.0)
print(len(same) > 4 and all(same), torch.equal(kernel(saved), before),
      torch.equal(kernel(task.state_dict()), before + 1.0))
"""


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_a_keras_snapshot_copies_the_weights_once(backend):
    """The state a Keras task gives the elastic snapshot shares the variables' memory (the
    snapshot's own copy is then the only one), and the snapshot does not follow later steps."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", SNAPSHOT_CHECK], capture_output=True,
                          text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "True", "True"], proc.stdout
