"""The reference analysis's metric and sampling-fraction MRE, and `validate --generated`.

The oracle below is written the way the reference analysis is (a dict of per-bin arrays,
moments by a loop over orders, the metric accumulated bin by bin with its moment block run
twice), independently of mpilearn.calo.reference's vectorised code.
"""
import json
import math

import h5py
import numpy as np
import pytest

from conftest import mpirun
from mpilearn.calo import physics
from mpilearn.calo.format import measured_angle_np
from mpilearn.calo.reference import METRIC_ENERGIES, SF_ENERGIES
from mpilearn.calo.simulate import showers, simulate


def oracle_moments(sums, total, m):
    out = np.zeros((len(sums), m))
    mid = np.zeros(len(sums))
    for i in range(m):
        idx = np.tile(np.arange(sums.shape[1]), (len(sums), 1))
        powered = np.power((idx.T - mid).T, i + 1)
        value = np.einsum("ij,ij->i", sums, powered) / total
        if i == 0:
            mid = value
        out[:, i] = value
    return out


def oracle_metric(images_mc, images_gan, energy, theta, energies, m=2):
    var = {}
    for e in energies:
        idx = np.arange(min(len(energy), 5000)) if e == 0 else \
            np.where((energy > e - 5) & (energy < e + 5))[0]
        for kind, images in (("act", images_mc), ("gan", images_gan)):
            x = images[idx]
            total = x.sum(axis=(1, 2, 3))
            sums = [x.sum(axis=(2, 3)), x.sum(axis=(1, 3)), x.sum(axis=(1, 2))]
            for name, s in zip("XYZ", sums):
                var[f"sums{name}_{kind}{e}"] = s
                var[f"moment{name}_{kind}{e}"] = oracle_moments(s, total, m)
        var[f"angle_act{e}"] = theta[idx]
        var[f"angle_gan{e}"] = measured_angle_np(images_gan[idx])
    metricp = metrice = metrica = 0.0
    for e in energies:
        for _ in range(2):  # the reference's duplicated block
            errs = [(np.mean(var[f"moment{a}_act{e}"], 0) - np.mean(var[f"moment{a}_gan{e}"], 0))
                    / np.mean(var[f"moment{a}_act{e}"], 0) for a in "XYZ"]
            metricp += np.sum(sum(np.abs(err) for err in errs) / 3) / m
        prof = 0.0
        for a in "XYZ":
            act, gan = np.mean(var[f"sums{a}_act{e}"], 0), np.mean(var[f"sums{a}_gan{e}"], 0)
            prof += np.sum(np.abs((act - gan) / act)) / len(act)
        metrice += prof / 3
        metrica += np.mean(np.abs((var[f"angle_act{e}"] - var[f"angle_gan{e}"]) / var[f"angle_act{e}"]))
    n = len(energies)
    return metricp / n + metrice / n + metrica / n, metricp / n, metrice / n, metrica / n


def oracle_sf_mre(sf_act, sf_gan, energy, energies):
    metric, d = 0.0, 0.0
    for e in energies:
        sel = (energy > e - 5) & (energy < e + 5)
        a, g = sf_act[sel], sf_gan[sel]
        metric += abs(a.mean() - g.mean()) / a.mean()
        d += np.std(g) ** 2 / len(a) + (np.std(a) / g.mean()) ** 2 / len(a)
    return metric / len(energies), math.sqrt(d / len(energies))


@pytest.fixture(scope="module")
def samples():
    """MC and a 'GAN' that differs: other showers, energies smeared, a little noise."""
    rng = np.random.default_rng(3)
    n = 600
    energy = rng.choice([110.0, 150.0, 190.0], n) + rng.uniform(-4.9, 4.9, n)
    theta = rng.uniform(math.radians(60), math.radians(120), n)
    mc = showers(energy, theta, (51, 51, 25), np.random.default_rng(1))
    gan = showers(energy * 1.05, theta, (51, 51, 25), np.random.default_rng(2))
    # every cell gets some energy on average: the reference's profile term stays finite
    mc, gan = mc + 1e-7, gan + rng.uniform(0, 2e-7, gan.shape)
    return energy, measured_angle_np(mc), mc, gan


def test_reference_metric_equals_the_reference_computation(samples):
    energy, theta, mc, gan = samples
    fa, fb = physics.features(mc, energy, theta), physics.features(gan, energy, theta)
    got = physics.score(fa, fb)
    total, moments, profiles, angle = oracle_metric(mc, gan, energy, theta, METRIC_ENERGIES["reduced"])
    assert got["reference_bins"] == [0, 110, 150, 190]
    assert got["reference_moments"] == pytest.approx(moments, rel=1e-9)
    assert got["reference_profiles"] == pytest.approx(profiles, rel=1e-9)
    assert got["reference_angle"] == pytest.approx(angle, rel=1e-9)
    assert got["reference_metric"] == pytest.approx(total, rel=1e-9) and total > 0.01
    mre, err = oracle_sf_mre(fa["sampling_fraction"], fb["sampling_fraction"], energy,
                             SF_ENERGIES["reduced"])
    assert got["sampling_fraction_mre"] == pytest.approx(mre, rel=1e-9) and mre > 0.01
    assert got["sampling_fraction_mre_error"] == pytest.approx(err, rel=1e-9)
    assert {f"sampling_fraction_mre_{e}" for e in (110, 150, 190)} <= set(got)


def test_reference_metric_of_identical_samples_is_zero(samples):
    energy, theta, mc, _ = samples
    fa = physics.features(mc, energy, theta)
    got = physics.score(fa, fa)
    for key in ("reference_metric", "reference_moments", "reference_profiles", "reference_angle",
                "sampling_fraction_mre", "score"):
        assert got[key] == 0.0, key


def test_full_range_bins_and_bin_zero_takes_the_first_5000_events():
    rng = np.random.default_rng(0)
    energy = rng.uniform(10, 500, 60)
    from mpilearn.calo.reference import energy_set, select

    assert energy_set(energy) == "full" and energy_set(np.array([100.0, 200.0])) == "reduced"
    assert list(select(np.zeros(6000), 0)) == list(range(5000))
    inside = select(np.array([104.9, 95.0, 105.0, 100.0]), 100)
    assert list(inside) == [0, 3]  # an open interval of ±5 GeV


def test_empty_mc_cells_are_counted(samples):
    energy, theta, mc, gan = samples
    mc = mc.copy()
    mc[:, 0] = 0.0  # an x slice with no MC energy at all
    got = physics.score(physics.features(mc, energy, theta), physics.features(gan, energy, theta))
    assert got["reference_profiles"] == math.inf and got["reference_empty_mc_cells"] > 0


def test_validate_generated_second_sample_and_json(showers_dir, tmp_path):
    files = f"{showers_dir}/*.h5"
    proc = mpirun(2, ["-m", "mpilearn.validate", "--generated", files, "--mc", files,
                      "--events", "80", "--output", str(tmp_path / "same"), "--voxel-events", "30",
                      "--seeds", "2",
                      "--json", str(tmp_path / "same.json")])
    assert proc.returncode == 0, proc.stderr
    same = json.load(open(tmp_path / "same.json"))
    assert same["events"] == 80  # 160 MC events: 80 compared, 80 more for the floor
    assert same["reference_metric"] == pytest.approx(0, abs=1e-6)  # mtheta vs measured: float
    assert same["score"] == pytest.approx(0, abs=1e-12)  # paired by conditions: reordered sums
    assert same["sampling_fraction_mre"] == pytest.approx(0, abs=1e-12)
    assert "reference_metric" in proc.stdout and "sampling_fraction_mre" in proc.stdout
    for name in ("reference_observables.png", "sampling_fraction.png", "validation.json"):
        assert (tmp_path / "same" / name).exists(), name
    # 32 validation events per classifier run: 0.5 within its noise
    assert same["auc_high"] == pytest.approx(0.5, abs=0.2) and same["fpd"] < 1e-6
    assert "fpd" in proc.stdout and "auc_high" in proc.stdout
    assert "verdict (lower is better" in proc.stdout and "score at the MC floor" in proc.stdout
    assert same["auc_low_events"] == 30 and 0 <= same["auc_low"] <= 1 and same["auc_low_floor"]
    # a second, independent MC sample, each event with its own conditioning: paired by (E, θ)
    # as the floor is (paired by order, it scored 6.7 x the floor)
    other = tmp_path / "other"
    simulate(str(other), 120, "angle", (100, 200), 5, 120, progress=False)
    proc = mpirun(1, ["-m", "mpilearn.validate", "--generated", f"{other}/*.h5", "--mc", files,
                      "--events", "100", "--no-plots", "--json", str(tmp_path / "other.json"),
                      "--voxel-events", "0",
                      "--output", str(tmp_path / "o")])
    assert proc.returncode == 0, proc.stderr
    result = json.load(open(tmp_path / "other.json"))
    assert 0 < result["sampling_fraction_mre"] < 0.2 and result["reference_metric"] > 0
    assert result["score_ratio"] < 2, result
    # the verdict in words: MC against MC is at the floor
    assert "the project's score: score at the MC floor" in proc.stdout, proc.stdout
    assert result["generated_condition_mismatch"]["angle_ks_pvalue"] > 1e-3
    # showers made for other energies are refused, with the reason
    far = tmp_path / "far"
    simulate(str(far), 60, "angle", (20, 60), 6, 60, progress=False)
    proc = mpirun(1, ["-m", "mpilearn.validate", "--generated", f"{far}/*.h5", "--mc", files,
                      "--events", "30", "--no-plots", "--no-classifier",
                      "--output", str(tmp_path / "f")])
    assert proc.returncode == 2 and "other conditions than the MC's" in proc.stderr, proc.stderr
    assert "mpilearn.generate --conditions" in proc.stderr   # the flag that makes them


def test_validate_generated_without_its_angle_is_bad_input(showers_dir, tmp_path):
    bad = tmp_path / "noangle.h5"
    with h5py.File(next(showers_dir.glob("*.h5"))) as src, h5py.File(bad, "w") as dst:
        for key in ("ECAL", "energy"):
            dst[key] = src[key][:]
    proc = mpirun(2, ["-m", "mpilearn.validate", "--generated", str(bad), "--mc",
                      f"{showers_dir}/*.h5", "--output", str(tmp_path / "v")])
    assert proc.returncode == 2
    assert proc.stderr.count("mtheta") == 1 and str(bad) in proc.stderr
    assert not (tmp_path / "v").exists()
    proc = mpirun(1, ["-m", "mpilearn.validate", "--mc", f"{showers_dir}/*.h5"])
    assert proc.returncode == 2 and "--checkpoint" in proc.stderr


def test_every_number_is_a_metric_an_hpo_objective_can_name():
    import os
    import sys

    from conftest import REPO
    from mpilearn.core.config import resolve
    from mpilearn.train.callbacks import logged_metrics

    sys.path.insert(0, os.path.join(REPO, "models"))
    import gan3d

    config = resolve(None, ["train.validate_every=1"], require_model=False)
    angle = logged_metrics(gan3d.build({"preset": "small"}), config)
    assert {"score", "reference_metric", "sampling_fraction_mre", "physics_reference_angle",
            "physics_reference_moments", "physics_angle", "sampling_fraction_mre_error",
            "sampling_fraction_mre_ratio", "fpd", "fpd_sigma", "kpd_sigma", "separation_power_ratio"
            } <= angle
    assert not {"fpd_ratio", "kpd_ratio"} & angle   # a floor 0 within its error: σ, no ratio
    assert "auc_high" not in angle   # the classifier runs only with train.classifier_every
    fixed = logged_metrics(gan3d.build({"variant": "fixed"}), config)
    assert "reference_metric" in fixed and not {"physics_angle", "physics_reference_angle"} & fixed
    # validate's names are the monitors' and objectives' names (one name everywhere)
    from mpilearn.train.checks import check_monitor

    config = resolve(None, ["train.validate_every=1", "train.classifier_every=2",
                            "train.best.monitor=sampling_fraction_mre_ratio",
                            "train.early_stopping.monitor=auc_high",
                            "train.early_stopping.patience=3"], require_model=False)
    assert check_monitor(config, gan3d.build({"preset": "small"}), True) == {
        "best": ("sampling_fraction_mre_ratio", "min"), "early_stopping": ("auc_high", "min")}


@pytest.fixture(scope="module")
def halves():
    """Two disjoint MC samples, and a perfect generator: the simulator again, at the first
    sample's conditions, with other random numbers."""
    def sample(seed, energy=None, theta=None, n=160):
        rng = np.random.default_rng(seed)
        energy = rng.uniform(100, 200, n) if energy is None else energy
        theta = rng.uniform(math.radians(60), math.radians(120), n) if theta is None else theta
        return physics.features(showers(energy, theta, (51, 51, 25), rng), energy, theta)

    first, second = sample(1), sample(2)
    perfect = sample(3, first["energy"], first["condition_angle"])
    return first, second, perfect


def test_a_sample_against_itself_scores_zero_beside_a_positive_floor(halves):
    first, second, _ = halves
    got, _ = physics.with_floor(physics.score(first, first), first, second)
    assert got["score"] == 0 and got["score_ratio"] == 0
    assert got["score_floor"] > 0.01 and got["floor_events"] == len(first["energy"])
    # the reference's angle term compares the conditioning angle with the measured one
    assert got["reference_filled_moments"] == 0 and got["reference_filled_profiles"] == 0
    assert got["reference_metric_filled_floor"] > got["reference_metric_filled"]


def test_a_perfect_generator_scores_near_the_floor_a_wrong_one_far_above(halves):
    first, second, perfect = halves
    got, _ = physics.with_floor(physics.score(first, perfect), first, second)
    assert 0.6 < got["score_ratio"] < 1.5, got
    assert 0.6 < got["reference_metric_filled_ratio"] < 1.5, got
    # the conditions' angle ignored: the showers of the second sample, paired by order
    wrong, _ = physics.with_floor(physics.score(first, second), first, second)
    assert wrong["score_ratio"] > 3, wrong


def test_halves_are_disjoint_and_of_one_size():
    first, second = physics.halves(np.arange(11), 4)
    assert list(first) == [0, 1, 2, 3] and list(second) == [4, 5, 6, 7]
    first, second = physics.halves(np.arange(7), 100)
    assert list(first) == [0, 1, 2] and list(second) == [3, 4, 5]


def test_filled_metric_equals_the_exact_one_when_no_cell_is_empty(samples):
    energy, theta, mc, gan = samples  # every cell has some energy on average
    got = physics.score(physics.features(mc, energy, theta), physics.features(gan, energy, theta))
    assert got["reference_filled_skipped_cells"] == 0
    assert got["reference_metric_filled"] == pytest.approx(got["reference_metric"], rel=1e-12)
    assert got["reference_metric"] > 0.01
    mc = mc.copy()
    mc[:, 0] = 0.0  # an x slice with no MC energy: exact is infinite, filled leaves it out
    got = physics.score(physics.features(mc, energy, theta), physics.features(gan, energy, theta))
    assert got["reference_metric"] == math.inf
    assert math.isfinite(got["reference_metric_filled"])
    assert got["reference_filled_skipped_cells"] == 4  # one x cell in each of the 4 bins


def test_validate_generated_second_mc_sample_scores_near_the_floor(showers_dir, tmp_path):
    """Another MC sample at the MC's own conditions (a perfect generator) through
    validate --generated: score ratio about 1."""
    other = tmp_path / "perfect"
    other.mkdir()
    for i, path in enumerate(sorted(showers_dir.glob("*.h5"))):
        with h5py.File(path) as src, h5py.File(other / path.name, "w") as dst:
            for key in src:
                dst[key] = src[key][:]
            gev = showers(src["energy"][:].astype(np.float64), src["theta"][:].astype(np.float64),
                          (51, 51, 25), np.random.default_rng(100 + i))
            dst["ECAL"][...] = (gev * 50.0).astype(np.float32)
    proc = mpirun(2, ["-m", "mpilearn.validate", "--generated", f"{other}/*.h5", "--mc",
                      f"{showers_dir}/*.h5", "--events", "80", "--json", str(tmp_path / "r.json"),
                      "--voxel-events", "0",
                      "--output", str(tmp_path / "v")])
    assert proc.returncode == 0, proc.stderr
    result = json.load(open(tmp_path / "r.json"))
    assert result["events"] == 80 and result["floor_events"] == 80
    assert 0.5 < result["score_ratio"] < 1.6, result
    assert math.isfinite(result["reference_metric_filled"])
    assert "MC-vs-MC floor" in proc.stdout
    # the folder is there now: refused (nothing read), unless --overwrite
    again = ["-m", "mpilearn.validate", "--generated", f"{other}/*.h5", "--mc",
             f"{showers_dir}/*.h5", "--events", "20", "--no-plots", "--no-classifier",
             "--output", str(tmp_path / "v")]
    proc = mpirun(2, again)
    assert proc.returncode == 2 and proc.stderr.count(f"--output {tmp_path / 'v'} exists") == 1
    assert (tmp_path / "v" / "profiles.png").exists()
    proc = mpirun(1, again + ["--overwrite"])
    assert proc.returncode == 0, proc.stderr
    assert json.load(open(tmp_path / "v" / "validation.json"))["events"] == 20
    assert not (tmp_path / "v" / "profiles.png").exists()  # replaced, not mixed


def test_features_of_a_batch_with_no_event():
    """A validation batch whose showers all fail the sum > 10 selection (an early generator's
    empty showers) has no event left: features are empty arrays, not a reshape error."""
    f = physics.features(np.zeros((0, 51, 51, 25)), np.zeros(0), np.zeros(0), np.zeros(0, int))
    assert len(f["sum"]) == 0 and f["moments"].shape == (0, 3, 2) and f["spectrum"].shape[0] == 0


def test_the_floor_is_a_seeded_split_of_the_mc_alone(showers_dir, tmp_path):
    """The floor depends on the MC file, --events and --seed, not on what it is compared with
    (it moved with the generated file's size: 0.0818, 0.0959, 0.0855 against one MC)."""
    from mpilearn.calo.validate import split_mc

    a, b = split_mc(160, None), split_mc(160, None)
    assert list(a) == list(b) and len(set(a)) == 160   # every event, two halves of 80
    assert set(split_mc(160, None, seed=1)[:80]) != set(a[:80])
    assert len(split_mc(160, 30)) == 60 and len(split_mc(7, None)) == 6
    files = f"{showers_dir}/*.h5"
    short = tmp_path / "short.h5"
    with h5py.File(next(showers_dir.glob("*.h5"))) as src, h5py.File(short, "w") as dst:
        for key in src:
            dst[key] = src[key][:60]
    floors = []
    for i, generated in enumerate([files, files, str(short)]):
        proc = mpirun(1, ["-m", "mpilearn.validate", "--generated", generated, "--mc", files,
                          "--no-plots", "--no-classifier", "--json", str(tmp_path / f"{i}.json"),
                          "--output", str(tmp_path / f"v{i}")])
        assert proc.returncode == 0, proc.stderr
        got = json.load(open(tmp_path / f"{i}.json"))
        floors.append([got[k] for k in ("score_floor", "fpd_floor", "fpd_floor_error",
                                        "kpd_floor", "floor_events")])
        assert "MC floor" in proc.stdout and "σ" in proc.stdout, proc.stdout
    assert floors[0] == floors[1] and floors[0][-1] == 80, floors   # every event: 80 a side
