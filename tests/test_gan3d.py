"""3DGAN: faithful networks, synthetic showers, physics score, distributed GAN protocol."""
import json
import math
import os
import re
import sys

import h5py
import numpy as np
import pytest
import torch

from conftest import REPO, TESTS, mpirun, train_args
from mpilearn.calo import physics
from mpilearn.calo.format import Preprocess, measured_angle_np
from mpilearn.calo.simulate import showers, simulate
from mpilearn.train import checkpoint as ckpt

sys.path.insert(0, os.path.join(REPO, "models"))
import gan3d  # noqa: E402

GAN = os.path.join(REPO, "models", "gan3d.py")


def trainable(m):
    return sum(p.numel() for p in m.parameters() if p.requires_grad)


@pytest.mark.parametrize("hp,g_count,d_count,shape,outputs", [
    ({"variant": "angle"}, 1364983, 87354, (51, 51, 25), 4),
    ({"variant": "fixed"}, 872808, 73402, (25, 25, 25), 3),
])
def test_reference_parameter_counts_and_shapes(hp, g_count, d_count, shape, outputs):
    g, d = gan3d.networks(hp)
    assert trainable(g) == g_count and trainable(d) == d_count
    latent = 256 if hp["variant"] == "angle" else 200
    g.eval(), d.eval()
    with torch.no_grad():
        x = g(torch.randn(2, latent))
        out = d(x)
    assert x.shape == (2, 1) + shape and (x >= 0).all()  # ReLU output
    assert len(out) == outputs and all(o.shape == (2,) for o in out)
    assert ((out[0] > 0) & (out[0] < 1)).all()  # sigmoid real/fake


def test_faithful_details():
    g, d = gan3d.networks({"variant": "angle"})
    bns = [m for m in list(g.modules()) + list(d.modules()) if isinstance(m, torch.nn.BatchNorm3d)]
    assert bns and all(b.momentum == 0.01 and b.eps == 1e-6 for b in bns)
    assert all(m.negative_slope == 0.3 for m in d.modules() if isinstance(m, torch.nn.LeakyReLU))
    assert all(m.mode == "nearest" for m in g.modules() if isinstance(m, torch.nn.Upsample))
    task = gan3d.build({"preset": "small"})
    for opt in task.optimizers().values():
        group = opt.param_groups[0]
        assert isinstance(opt, torch.optim.RMSprop)
        assert (group["lr"], group["alpha"], group["eps"]) == (1e-3, 0.9, 1e-7)
    assert task.weights.tolist() == pytest.approx([3.0, 0.1, 25.0, 0.1])
    assert gan3d.build({"variant": "fixed"}).weights.tolist() == pytest.approx([2.0, 0.1, 0.1])


def test_small_preset_keeps_interface():
    g, d = gan3d.networks({"preset": "small"})
    with torch.no_grad():
        out = d(g(torch.randn(3, 256)))
    assert len(out) == 4 and trainable(g) < trainable(gan3d.networks({})[0])


def test_measured_angle_follows_a_tilted_track():
    img = np.zeros((1, 51, 51, 25))
    for z in range(25):  # y moves by cot(60°) cells per layer
        img[0, 25, int(25 + (z - 12) / math.tan(math.radians(60))), z] = 1.0
    assert measured_angle_np(img)[0] == pytest.approx(math.radians(60), abs=0.05)
    assert measured_angle_np(np.zeros((1, 51, 51, 25)))[0] == 100.0


@pytest.fixture(scope="module")
def mc_pair():
    """Two independent MC samples with the same (E, θ) per event."""
    rng = np.random.default_rng(5)
    n = 300
    energy = rng.uniform(20, 400, n)
    theta = rng.uniform(math.radians(60), math.radians(120), n)
    a = showers(energy, theta, (51, 51, 25), np.random.default_rng(1))
    b = showers(energy, theta, (51, 51, 25), np.random.default_rng(2))
    return energy, theta, a, b


def test_simulator_sampling_fraction_and_angle(mc_pair):
    energy, theta, a, _ = mc_pair
    sf = a.reshape(len(a), -1).sum(1) / energy
    assert 0.01 <= sf.mean() <= 0.03
    low, high = sf[energy < 100].mean(), sf[energy > 300].mean()
    assert high < low  # leakage and the sampling-fraction fit: falls with energy
    assert np.corrcoef(measured_angle_np(a), theta)[0, 1] > 0.9


def test_score_mc_vs_mc_near_zero_untrained_far_worse(mc_pair):
    energy, theta, a, b = mc_pair
    fa, fb = physics.features(a, energy, theta), physics.features(b, energy, theta)
    same = physics.score(fa, fb)
    assert same["score"] < 0.15, same
    task = gan3d.build({})
    fake = Preprocess("angle").to_gev(task.generate((energy / 100).astype(np.float32),
                                                    measured_angle_np(a).astype(np.float32),
                                                    np.arange(len(energy))))
    untrained = physics.score(fa, physics.features(fake, energy, theta))
    assert untrained["score"] > 10 * same["score"], untrained


def test_simulate_cli_files_like_the_real_data(tmp_path):
    proc = mpirun(1, ["-m", "mpilearn.simulate", "--events", "30", "--events-per-file", "20",
                      "--output", str(tmp_path), "--energy", "100", "200", "--seed", "3"])
    assert proc.returncode == 0, proc.stderr
    names = sorted(os.listdir(tmp_path))
    assert names == ["Ele_VarAngleMeas_100_200_000.h5", "Ele_VarAngleMeas_100_200_001.h5"]
    with h5py.File(tmp_path / names[0]) as f:
        assert f["ECAL"].shape == (20, 51, 51, 25)
        assert {"energy", "theta", "eta", "mtheta", "sum"} <= set(f)
        assert 100 <= f["energy"][:].min() and f["energy"][:].max() <= 200
        # GeV x 50 at a ~2 % sampling fraction: the raw sum is about the energy in GeV
        assert 0.8 < f["ECAL"][:].reshape(20, -1).sum(1).mean() / f["energy"][:].mean() < 1.2
        first = f["ECAL"][:]
    again = simulate(str(tmp_path / "again"), 30, "angle", (100, 200), 3, 20, progress=False)
    with h5py.File(again[0]) as f:
        np.testing.assert_array_equal(f["ECAL"][:], first)  # seeded: reproducible
    fixed = simulate(str(tmp_path / "fixed"), 10, "fixed", (10, 50), 0, 10, progress=False)
    with h5py.File(fixed[0]) as f:
        assert f["ECAL"].shape == (10, 25, 25, 25) and f["target"][:, 1].min() >= 10


def test_preprocessing_angle_format():
    raw = np.zeros((3, 51, 51, 25), np.float32)
    raw[0, 25, 25, 10] = 50.0   # kept: Σ = 50 > 10
    raw[1, 25, 25, 10] = 5.0    # filtered: Σ <= 10
    raw[2, 20, 20, 5] = 30.0
    raw[2, 0, 0, 0] = 5e-5      # below the 1e-4 threshold
    out = Preprocess("angle")({"ECAL": raw, "energy": np.array([150, 150, 120.0]),
                               "_index": np.array([7, 8, 9])})
    assert out["_index"].tolist() == [7, 9]
    assert out["energy"].tolist() == pytest.approx([1.5, 1.2])
    assert out["ecal"].tolist() == pytest.approx([50.0, 30.0])  # before the power
    assert out["images"][0, 25, 25, 10] == pytest.approx(50 ** 0.85, rel=1e-5)
    assert out["images"][1, 0, 0, 0] == 0.0
    assert "angle" in out and out["angle"].shape == (2,)  # measured, as the file lacks mtheta


def gan_run(np_, folder, out, batch, *extra):
    return mpirun(np_, train_args(
        "--set", f"model={GAN}", "--set", f"data.files=[{folder}/*.h5]", "--set", "data.val_fraction=0.2",
        "--set", "hparams.preset=small", "--set", f"train.batch_size={batch}",
        "--set", "train.max_steps_per_epoch=3", "--output", str(out), *extra), timeout=600)


def test_two_rank_gan_equals_one_rank_with_double_batch(showers_dir, tmp_path):
    """Exact up to batch norm: with BN and dropout off and float64 arithmetic (so that the
    order of the allreduce sums cannot matter), any difference is a protocol bug."""
    exact = ["--set", "hparams.batch_norm=false", "--set", "hparams.dropout=0.0",
             "--set", "hparams.dtype=float64",
             "--set", "train.base_batch=8"]  # the lr was tuned at the global batch: no rule
    one = gan_run(1, showers_dir, tmp_path / "one", 8, *exact)
    two = gan_run(2, showers_dir, tmp_path / "two", 4, *exact)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    a = ckpt.load(ckpt.latest(str(tmp_path / "one" / "checkpoints")))["task"]["models"]
    b = ckpt.load(ckpt.latest(str(tmp_path / "two" / "checkpoints")))["task"]["models"]
    torch.manual_seed(0)  # the engine seeds train.seed (0) before building: the initial weights
    init = gan3d.build({"preset": "small", "batch_norm": False, "dropout": 0.0, "dtype": "float64"})
    moved = False
    for net in ("generator", "discriminator"):
        for k in a[net]:
            np.testing.assert_allclose(b[net][k].numpy(), a[net][k].numpy(), rtol=1e-7, atol=1e-10)
            moved |= not torch.allclose(a[net][k], init.models()[net].state_dict()[k])
    assert moved
    la = json.loads(open(tmp_path / "one" / "metrics.jsonl").readline())
    lb = json.loads(open(tmp_path / "two" / "metrics.jsonl").readline())
    assert lb["train_d_loss"] == pytest.approx(la["train_d_loss"], rel=1e-7)
    assert lb["train_g_loss"] == pytest.approx(la["train_g_loss"], rel=1e-7)


def test_reference_ecal_fit_and_the_fake_batch_conditions():
    """3dgan.md §2a: the 25x25x25 model's fake batches sample E' ~ U(10, 500) GeV, fresh for
    D's fake batch and each G update, with Σ from GetEcalFit; the angle model reuses the real
    batch's E, θ and Σ."""
    from mpilearn.calo.format import ecal_fit

    for e_gev, fraction in ((10, 0.0218), (100, 0.0202), (200, 0.0193), (500, 0.0181)):
        assert ecal_fit(e_gev / 100) / 100 / e_gev == pytest.approx(fraction, abs=5e-5)
    fixed = gan3d.build({"variant": "fixed"})
    _, _, sampled = fixed._draws(np.arange(400), 3)
    assert sampled.shape == (3, 400) and sampled.min() >= 0.1 and sampled.max() <= 5.0
    assert abs(np.corrcoef(sampled[0], sampled[1])[0, 1]) < 0.2  # fresh per set
    real = (np.full(4, 1.5), None, np.full(4, 300.0))
    e, a, s = fixed.fake_conditions(1, *real, sampled[:, :4])
    assert np.array_equal(e, sampled[1, :4]) and a is None
    np.testing.assert_allclose(s, ecal_fit(sampled[1, :4]))
    angle = gan3d.build({"preset": "small"})
    real = (np.full(4, 1.5), np.full(4, 1.6), np.full(4, 300.0))
    assert all(x is y for x, y in zip(angle.fake_conditions(2, *real, sampled[:, :4]), real))


def test_fixed_model_trains_its_fake_batches_on_sampled_energies():
    from mpilearn.calo.format import Preprocess

    rng = np.random.default_rng(0)
    task = gan3d.build({"variant": "fixed", "dropout": 0.0})
    task.setup(None, "cpu", "mpi", 1 << 20, distributed=False)
    seen, latent_input = [], task.latent_input
    task.latent_input = lambda noise, e, a: (seen.append(e.clone()), latent_input(noise, e, a))[1]
    batch = Preprocess("fixed")({"ECAL": rng.random((3, 25, 25, 25)) * 0.01,
                                 "energy": np.full(3, 150.0), "_index": np.arange(3)})
    task.train_step(batch)
    _, _, sampled = task._draws(batch["_index"], 0)
    assert len(seen) == 3  # D's fake batch and the two G updates
    for k, e in enumerate(seen):
        np.testing.assert_allclose(e.numpy(), sampled[k], rtol=1e-6)


def test_measured_angle_counts_faint_layers_as_the_reference_does():
    """Only an exact 0 is empty (measPython); an empty event measures 100."""
    from mpilearn.calo.format import EMPTY_ANGLE, measured_angle

    img = torch.zeros(3, 51, 51, 25, dtype=torch.float64)
    for z in range(5, 20):          # a tilted track
        img[1:, 25, 20 + z // 2, z] = 1.0
    img[2, 25, 45, 22] = 1e-6      # one faint layer far off the track
    angle = measured_angle(img)
    assert angle[0] == EMPTY_ANGLE
    assert angle[1] != EMPTY_ANGLE and angle[2] != angle[1]  # the faint layer counts
    faint_only = torch.zeros(1, 51, 51, 25, dtype=torch.float64)
    faint_only[0, 25, 25, 3] = 1e-8
    assert measured_angle(faint_only)[0] != EMPTY_ANGLE


def test_bf16_autocast_step_stays_close_to_fp32():
    """train.precision=bf16: the four updates run under autocast (here on the CPU), the loss
    terms in float32, the weights stay float32 and the losses stay near fp32's."""
    from mpilearn.calo.format import Preprocess

    rng = np.random.default_rng(0)
    raw = {"ECAL": rng.random((6, 51, 51, 25), dtype=np.float32), "energy": rng.uniform(100, 200, 6),
           "mtheta": rng.uniform(1.0, 2.1, 6), "_index": np.arange(6)}
    batch = Preprocess("angle")(raw)
    losses = {}
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        task = gan3d.build({"preset": "small", "dropout": 0.0})
        task.setup(None, "cpu", "mpi", 1 << 20, distributed=False)
        task.precision = precision
        losses[precision] = task.train_step(batch)
        assert all(p.dtype == torch.float32 for p in task.generator.parameters())
    # D on the real batch comes before any update: only bf16 rounding separates the two
    assert losses["bf16"]["d_real"] == pytest.approx(losses["fp32"]["d_real"], rel=0.01)
    assert losses["bf16"]["d_real"] != losses["fp32"]["d_real"]  # autocast did something
    # after RMSprop's first (nearly sign-sized) steps, rounding moves the rest more
    for key in ("d_loss", "g_loss"):
        assert losses["bf16"][key] == pytest.approx(losses["fp32"][key], rel=0.15)


def test_gan_training_with_validation_and_validate_cli(showers_dir, tmp_path):
    out = tmp_path / "run"
    proc = gan_run(2, showers_dir, out, 4, "--set", "train.epochs=2", "--set", "train.validate_every=1",
                   "--set", "train.physics_events=40", "--set", "train.log=[jsonl,tensorboard]",
                   "--set", "train.classifier_every=2")
    assert proc.returncode == 0, proc.stderr
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0}).Reload()
    assert "epoch/score" in board.Tags()["scalars"]  # the physics score, and its plots
    assert {"validation/profiles", "validation/spectra"} <= set(board.Tags()["images"])
    assert [i.step for i in board.Images("validation/profiles")] == [1, 2]
    lines = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert len(lines) == 2 and all(np.isfinite(l["score"]) for l in lines)
    # the reference analysis's numbers beside the project's score, every validation
    assert all({"reference_metric", "sampling_fraction_mre", "physics_reference_moments",
                "physics_sampling_fraction_mre_150"} <= set(l) for l in lines)
    # ... finite over the cells the MC fills, and the score beside its MC-vs-MC floor
    assert all(np.isfinite(l["reference_metric_filled"]) and l["score_floor"] > 0
               and l["score_ratio"] == pytest.approx(l["score"] / l["score_floor"]) for l in lines)
    # the CaloChallenge's numbers every validation, the classifier every second one
    assert all(l["fpd_floor"] is not None and "separation_power_ratio" in l for l in lines)
    assert "auc_high" not in lines[0] and 0 <= lines[1]["auc_high"] <= 1
    # a short epoch line: the headline numbers with their floor ratios, no raw dict
    epoch_lines = [l for l in proc.stdout.splitlines() if l.startswith("epoch ")]
    assert len(epoch_lines) == 2 and all("x floor)" in l and "{" not in l for l in epoch_lines)
    # (FPD and KPD carry their σ and floor with its error: about 40 characters each)
    assert "auc_high" in epoch_lines[1] and len(epoch_lines[1]) < 360, epoch_lines
    assert "train_g_loss" in epoch_lines[0] and "train_g_ecal" not in epoch_lines[0]  # no terms
    assert {"train_d_loss", "train_g_loss", "train_g_ecal", "val_d_loss", "val_g_loss"} <= set(lines[0])
    for name in ("profiles.png", "sampling_fraction.png", "spectra.png", "validation.json",
                 "reference_observables.png", "discriminator.png"):
        assert (out / "validation" / "epoch0002" / name).exists()
    proc = mpirun(2, ["-m", "mpilearn.validate", "--checkpoint", str(out), "--mc",
                      f"{showers_dir}/*.h5", "--events", "60", "--output", str(tmp_path / "val"),
                      "--voxel-events", "0"])
    assert proc.returncode == 0, proc.stderr
    result = json.load(open(tmp_path / "val" / "validation.json"))
    assert result["events"] == 60 and result["score"] > 0
    # the verdict says how far the (barely trained) generator is, in floors
    verdict = next(l for l in proc.stdout.splitlines() if "the project's score:" in l)
    assert re.search(r"score [\d.e+]+x the MC floor", verdict), proc.stdout
    assert {"moments", "profiles", "angle", "sampling_fraction_mc", "reference_metric",
            "reference_angle", "sampling_fraction_mre_error"} <= set(result)
    assert (tmp_path / "val" / "profiles.png").stat().st_size > 10000
    # the exported generator in plain PyTorch, as the README shows it
    generator, _ = gan3d.networks({"preset": "small"})
    generator.load_state_dict(torch.load(out / "models" / "generator.pt", weights_only=True))
    generator.eval()
    with torch.no_grad():
        latent = torch.cat([torch.full((3, 1), 1.5), torch.full((3, 1), 1.57), torch.randn(3, 254)], 1)
        showers = generator(latent).squeeze(1) ** (1 / 0.85)
    assert showers.shape == (3, 51, 51, 25) and torch.isfinite(showers).all()


def test_empty_generator_guard_stops_training(showers_dir, tmp_path):
    proc = mpirun(2, train_args(
        "--set", f"model={TESTS}/models/empty_gan.py", "--set", f"data.files=[{showers_dir}/*.h5]",
        "--set", "hparams.lr=0.0", "--set", "train.batch_size=2", "--set", "train.epochs=2",
        "--output", str(tmp_path / "run")), timeout=600)
    assert proc.returncode == 3, proc.stderr
    assert "emitted empty images for 10 batches" in proc.stderr
    last = json.loads(open(tmp_path / "run" / "metrics.jsonl").read().splitlines()[-1])
    assert "stopped" in last and last["step"] == 10


def _write(path, **datasets):
    with h5py.File(path, "w") as f:
        for k, v in datasets.items():
            f[k] = v


@pytest.mark.parametrize("case,message", [
    ("missing_key", "no dataset 'energy'"),
    ("wrong_shape", "dataset 'ECAL' has events of shape (25, 25, 25), expected (51, 51, 25)"),
    ("nan", "dataset 'ECAL' has NaN or infinite cells"),
    ("empty", "dataset 'ECAL' holds no events"),
])
def test_bad_calorimeter_files(tmp_path, case, message):
    path = tmp_path / f"{case}.h5"
    good = np.ones((4, 51, 51, 25), np.float32)
    if case == "missing_key":
        _write(path, ECAL=good)
    elif case == "wrong_shape":
        _write(path, ECAL=np.ones((4, 25, 25, 25), np.float32), energy=np.ones(4))
    elif case == "nan":
        good[1, 3, 3, 3] = np.nan
        _write(path, ECAL=good, energy=np.ones(4))
    else:
        _write(path, ECAL=np.zeros((0, 51, 51, 25), np.float32), energy=np.zeros(0))
    proc = mpirun(2, train_args("--set", f"model={GAN}", "--set", f"data.files=[{path}]",
                                "--set", "hparams.preset=small", "--output", str(tmp_path / "run")))
    assert proc.returncode == 2, proc.stderr
    assert str(path) in proc.stderr and message in proc.stderr
    assert proc.stderr.count("mpilearn: error:") == 1


def test_smooth_preset_has_no_six_cell_blocks():
    """The proposed smooth preset (issue 49): the small preset's x6 nearest-neighbour copy
    makes every 6th step of an untrained generator's x profile the large one; the smooth
    generator's steps are alike everywhere."""
    def six_cell_steps(preset):
        torch.manual_seed(0)
        generator, _ = gan3d.networks({"preset": preset})
        with torch.no_grad():
            profile = generator(torch.randn(32, 256)).squeeze(1).mean(0).sum((1, 2)).numpy()
        steps = np.abs(np.diff(profile))
        return steps[5::6].mean() / steps.mean()

    assert six_cell_steps("small") > 2 and six_cell_steps("smooth") < 1.5
    _, discriminator = gan3d.networks({"preset": "smooth"})
    assert len(discriminator.body) == len(gan3d.networks({"preset": "small"})[1].body)


def test_the_smooth_presets_widths_are_hyperparameters_a_sweep_can_set():
    def widths(hp):
        generator, discriminator = gan3d.networks({"preset": "smooth", **hp})
        convs = [m.out_channels for m in generator.body if isinstance(m, torch.nn.Conv3d)]
        d_convs = [m.out_channels for m in discriminator.body if isinstance(m, torch.nn.Conv3d)]
        return generator.channels, convs, d_convs[-1]

    assert widths({}) == (4, [15, 7, 7], 8)
    assert widths({"g_channels": [6, 16, 10], "d_channels": 12}) == (6, [16, 10, 10], 12)
    with pytest.raises(ValueError, match="hparams.g_channels must be 3 positive widths"):
        gan3d.networks({"preset": "smooth", "g_channels": [4, 12]})
