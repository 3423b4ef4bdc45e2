"""train.compile, train.channels_last, the device-side keyed draws and the one-read-per-batch
guards (issue 31), on the CPU."""
import os
import sys

import numpy as np
import pytest
import torch

from conftest import REPO, TESTS, mpirun, train_args
from mpilearn.calo.draws import philox
from mpilearn.calo.format import Preprocess
from mpilearn.errors import TrainingStopped, UsageError
from mpilearn.train import guard

sys.path.insert(0, os.path.join(REPO, "models"))
import gan3d  # noqa: E402
import mlp  # noqa: E402

SCRIPT = f"{TESTS}/scripts/compiled_step.py"


def results(path):
    data = np.load(path)
    return {k: data[k] for k in data.files}


def compare(d, variant, rtol):
    """Every weight of ``variant`` within rtol (of the tensor's largest value) of eager's."""
    keys = [k for k in d if k.startswith("eager/") and k.count("/") == 2]
    assert keys
    for k in keys:
        want, got = d[k], d[k.replace("eager/", variant + "/", 1)]
        scale = max(np.abs(want).max(), 1e-12)
        assert np.abs(got - want).max() <= rtol * scale, (variant, k)


@pytest.mark.parametrize("np_", [1, 2])
def test_compiled_mlp_equals_eager_and_its_hooks_overlap(tmp_path, np_):
    out = str(tmp_path / "r.npz")
    proc = mpirun(np_, [SCRIPT, "mlp", "4", "3", out], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = results(out)
    compare(d, "compiled", 1e-9)
    np.testing.assert_allclose(d["compiled/losses"], d["eager/losses"], rtol=1e-9)
    assert not d["compiled/prefixed"] and not d["eager/prefixed"]  # state_dict keys unchanged
    # at np=2 every bucket starts from backward's post-accumulate hooks: 3 steps, >= 1 each
    assert (d["compiled/overlapped"] >= 3) == (np_ == 2) and d["compiled/overlapped"] == d["eager/overlapped"]


def test_compiled_and_channels_last_gan_equal_eager_at_one_and_two_ranks(tmp_path):
    """The small 3DGAN in float64, 2 steps (four updates each): compiled and channels-last
    follow eager. RMSprop's first steps are sign-like (g / sqrt(0.1 g^2)), so the weights are
    compared at 1e-4 of each tensor's scale; the first losses (before any update) tightly."""
    for np_ in (1, 2):  # the second launch reuses the first's compiled kernels (same shapes)
        out = str(tmp_path / f"{np_}.npz")
        proc = mpirun(np_, [SCRIPT, "gan", "4", "2", out], timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        d = results(out)
        for variant in ("compiled", "channels_last"):
            compare(d, variant, 1e-4)
            np.testing.assert_allclose(d[f"{variant}/losses"][0], d["eager/losses"][0], rtol=1e-8)
            assert not d[f"{variant}/prefixed"]
            assert (d[f"{variant}/overlapped"] >= 8) == (np_ == 2)  # 2 steps x 4 updates
        moved = [k for k in d if k.startswith("eager/generator/") and "weight" in k]
        assert moved


def test_compile_through_the_cli_keeps_plain_checkpoint_and_export_keys(toy_file, tmp_path):
    from mpilearn.train import checkpoint as ckpt

    runs = {}
    for mode in ("off", "default"):
        out = tmp_path / mode
        proc = mpirun(2, train_args("--set", f"model={REPO}/models/mlp.py", "--set", f"data.files=[{toy_file}]",
                                    "--set", "hparams.optimizer=sgd", "--set", "train.batch_size=16",
                                    "--set", "train.max_steps_per_epoch=4", "--set", f"train.compile={mode}",
                                    "--output", str(out)), timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"compile {mode}" in proc.stdout
        runs[mode] = ckpt.load(ckpt.latest(str(out / "checkpoints")))["task"]["models"]["model"]
        exported = torch.load(out / "models" / "model.pt", weights_only=True)
        assert list(exported) == list(runs["off"])  # no _orig_mod. prefix
    for k, v in runs["off"].items():
        np.testing.assert_allclose(runs["default"][k].numpy(), v.numpy(), rtol=1e-5, atol=1e-6)


def test_compile_and_layout_config_values():
    from mpilearn.core.config import resolve
    from mpilearn.train.checks import check_framework

    c = resolve(None, ["model=m", "train.compile=off", "train.channels_last=false"])
    assert c["train"]["compile"] == "off" and c["train"]["channels_last"] == "false"
    c = resolve(None, ["model=m", "train.compile=max-autotune", "train.channels_last=true"])
    assert c["train"]["compile"] == "max-autotune" and c["train"]["channels_last"] == "true"
    assert resolve(None, ["model=m"])["train"]["channels_last"] == "auto"
    with pytest.raises(UsageError, match=r"'train.compile' is 'defualt'; choose one of off, default.*"
                                         r"\(did you mean 'default'\?\)"):
        resolve(None, ["model=m", "train.compile=defualt"])
    with pytest.raises(UsageError, match="'train.compile' must be a string, got True"):
        resolve(None, ["model=m", "train.compile=true"])

    class KerasTask:
        framework = "keras"
    with pytest.raises(UsageError, match="train.compile=default is for PyTorch models"):
        check_framework(KerasTask(), {"compile": "default", "backend": "mpi", "fusion_mb": 25.0})


class ScalarReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts aten._local_scalar_dense: what .item(), bool(t), float(t) dispatch to (each a
    host sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def gan_batch(n=6, seed=0, index0=0):
    rng = np.random.default_rng(seed)
    return Preprocess("angle")({"ECAL": rng.random((n, 51, 51, 25), dtype=np.float32) * 1.2,
                                "energy": rng.uniform(100, 200, n), "mtheta": rng.uniform(1.0, 2.1, n),
                                "_index": np.arange(index0, index0 + n)})


def test_one_host_read_per_batch():
    """The 3DGAN's four updates and a supervised step each read the device once (finite
    flags and losses together) and call no .item()/bool() (SGD: Adam reads its host-side
    step counter, which is no device sync)."""
    torch.manual_seed(0)
    gan = gan3d.build({"preset": "small"})
    gan.setup(None, "cpu", "mpi", 1 << 20, distributed=False)
    sup = mlp.build({"optimizer": "sgd"})
    sup.setup(None, "cpu", "mpi", 1 << 20, distributed=False)
    rng = np.random.default_rng(0)
    rows = {"X": rng.normal(size=(8, 8)).astype(np.float32), "y": rng.normal(size=(8, 1)).astype(np.float32)}
    for task, batch in ((gan, gan_batch()), (sup, rows)):
        task.train_step(batch)  # optimizer state created
        before, reads = guard.READS["count"], ScalarReads()
        with reads:
            out = task.train_step(batch)
        assert guard.READS["count"] - before == 1 and reads.count == 0, (type(task).__name__, reads.count)
        assert all(np.isfinite(v) for v in out.values())


def test_a_non_finite_gan_batch_is_undone_and_stops():
    torch.manual_seed(0)
    task = gan3d.build({"preset": "small"})
    task.setup(None, "cpu", "mpi", 1 << 20, distributed=False)
    task.train_step(gan_batch())
    weights = {n: {k: v.clone() for k, v in m.state_dict().items()} for n, m in task.models().items()}
    state = {n: [{k: v.clone() for k, v in s.items()} for s in o.state.values()]
             for n, o in task.optimizers().items()}
    bad = gan_batch(seed=1)
    bad["images"][0, 3, 3, 3] = np.nan
    with pytest.raises(TrainingStopped, match="non-finite gradients, step skipped \\(3DGAN update 1 of 4"):
        task.train_step(bad)
    for n, m in task.models().items():
        for k, v in m.state_dict().items():
            assert torch.equal(v, weights[n][k]), (n, k)
    for n, o in task.optimizers().items():
        for s, want in zip(o.state.values(), state[n]):
            assert all(torch.equal(torch.as_tensor(s[k]), torch.as_tensor(want[k])) for k in want)
    assert len(task.optimizers()["generator"].state) == len(state["generator"])


def test_philox_known_answers_on_numpy_and_torch():
    """Random123's known-answer vectors for Philox4x32-10."""
    cases = [((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
             ((0xffffffff,) * 4, (0xffffffff,) * 2, (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
             ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
              (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1))]
    for counter, key, want in cases:
        for make in (lambda v: np.array(v, dtype=np.int64), lambda v: torch.tensor(v, dtype=torch.int64)):
            assert tuple(int(w) for w in philox(*(make(c) for c in counter), key)) == want


def test_device_draws_are_keyed_per_event():
    """An event's draws depend on (seed, purpose, step, event) only: any subset of a batch
    (a rank's share) draws the same numbers; host and device streams agree."""
    task = gan3d.build({"preset": "small", "seed": 7})
    flips, noise, sampled = task._draws(np.arange(64), 5, device="cpu")
    part = task._draws(np.array([40, 3, 17]), 5, device="cpu")
    for whole, piece in zip((flips, noise.transpose(0, 1), sampled.T), (part[0], part[1].transpose(0, 1), part[2].T)):
        assert torch.equal(whole[[40, 3, 17]], piece)
    host = task._draws(np.arange(64), 5)
    np.testing.assert_allclose(host[1], noise.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(host[0], flips.numpy(), rtol=1e-6)
    assert noise.shape == (3, 64, 254) and flips.shape == (64, 2) and sampled.shape == (3, 64)
    z = noise.double().reshape(-1)
    assert abs(float(z.mean())) < 0.02 and abs(float(z.std()) - 1) < 0.02
    assert 0 < float(flips.min()) and float(flips.max()) < 1 and abs(float(flips.mean()) - 0.5) < 0.08
    assert 0.1 <= float(sampled.min()) and float(sampled.max()) <= 5.0
    for other in (task._draws(np.arange(64), 6, device="cpu"),                 # next step
                  task._draws(np.arange(64), 5, purpose=1, device="cpu"),      # generation
                  gan3d.build({"preset": "small", "seed": 8})._draws(np.arange(64), 5, device="cpu")):
        assert abs(float(torch.corrcoef(torch.stack([noise.reshape(-1), other[1].reshape(-1)]))[0, 1])) < 0.02
