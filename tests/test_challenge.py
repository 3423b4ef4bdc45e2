"""The CaloChallenge metrics (mpilearn.calo.challenge): jetnet's documented values for FPD and
KPD, and on simulated showers the issue's done-when checks: two MC samples paired by their
conditions are indistinguishable (AUC 0.5 +- 0.03, FPD and KPD 0 within their errors), and an
MC 7 % too hot and shifted by one cell is flagged by every metric."""
import math

import numpy as np
import pytest

from mpilearn.calo import challenge, physics
from mpilearn.calo.simulate import showers


def test_fpd_and_kpd_give_jetnets_documented_values():
    # jetnet's tests/evaluation/test_gen_metrics.py: two features, all 0 against all 2
    zeros, twos = np.zeros((2000, 2)), np.full((2000, 2), 2.0)
    assert challenge.fpd(zeros, zeros)[0] == pytest.approx(0, abs=0.01)
    value, error = challenge.fpd(twos, zeros)   # normalised: 1^2 + 1^2
    assert value == pytest.approx(2, rel=0.01) and error < 1e-3
    assert challenge.fpd(twos, zeros, normalise=False)[0] == pytest.approx(8, rel=0.01)
    assert challenge.kpd(zeros, zeros) == pytest.approx((0, 0))
    assert challenge.kpd(twos, zeros) == pytest.approx((15, 0))   # (1+1)^4 - 2 + 1
    assert challenge.kpd(twos, zeros, normalise=False) == pytest.approx((624, 0))


def test_frechet_distance_of_gaussians_and_auc_and_isotonic():
    rng = np.random.default_rng(0)
    x, y = rng.normal(0, 1, (20000, 2)), rng.normal(0, 2, (20000, 2))
    # |mu|^2 + tr(S1 + S2 - 2 sqrt(S1 S2)) = 0 + 2 (1 + 4 - 2 * 2)
    assert challenge.frechet_distance(x, y) == pytest.approx(2, rel=0.05)
    assert challenge.auc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]) == 1
    assert challenge.auc([0, 1, 0, 1], [0.5] * 4) == 0.5
    fit = challenge.isotonic(np.array([1, 2, 3, 4.0]), np.array([0, 1, 0, 1.0]))
    assert list(fit(np.array([0, 1.5, 2.5, 3.5, 9]))) == pytest.approx([1e-6, 0.5, 0.5, 1 - 1e-6,
                                                                         1 - 1e-6])
    # disjoint: 1, less the generated values clipped into the MC's last bin
    assert challenge.separation_power(np.arange(100.0)[:, None],
                                      np.arange(100.0)[:, None] + 1000)[0] > 0.9


@pytest.fixture(scope="module")
def samples():
    """Two independent MC samples of 600 showers paired by conditions, and the second made
    7 % too hot and shifted by one cell in x."""
    def draw(seed, n=600):
        rng = np.random.default_rng(seed)
        energy = rng.uniform(100, 200, n)
        theta = rng.uniform(math.radians(60), math.radians(120), n)
        return showers(energy, theta, (51, 51, 25), rng), energy, theta

    (a, ea, ta), (b, eb, tb) = draw(1), draw(2)
    first = physics.features(a, ea, ta)
    mc = physics.pair_by_conditions(first, physics.features(b, eb, tb))
    wrong = physics.pair_by_conditions(first, physics.features(np.roll(b * 1.07, 1, axis=1), eb, tb))
    return mc, wrong


def test_two_mc_samples_are_indistinguishable_a_distorted_one_is_flagged(samples):
    (first, second), (_, wrong) = samples
    mc = challenge.metrics(first, second, classifier=True, seeds=5)
    bad = challenge.metrics(first, wrong, classifier=True, seeds=5)
    assert abs(mc["auc_high"] - 0.5) < 0.03, mc["auc_high_seeds"]
    assert mc["fpd"] <= 2.5 * mc["fpd_error"] and abs(mc["kpd"]) <= 2.5 * mc["kpd_error"], mc
    assert bad["auc_high"] > 0.8
    # flagged: above the MC-vs-MC value's size (or error) more than twice, and 0 excluded (KPD's
    # error is the spread of ten 60-event batches, not of their median: 1 sigma here)
    for name, sigmas in (("fpd", 2), ("kpd", 1)):
        assert bad[name] > sigmas * bad[f"{name}_error"], name
        assert bad[name] > 2 * max(mc[name], mc[f"{name}_error"]), name
    assert bad["separation_power"] > 2 * mc["separation_power"]
    # per feature: the layer energies and the centre in x carry the distortion
    assert bad["separation_power_features"]["centre_x"] > 5 * mc["separation_power_features"]["centre_x"]


def test_validate_reports_each_challenge_number_beside_its_floor(samples):
    (first, second), (_, wrong) = samples
    got, _ = physics.with_floor(physics.score(first, wrong, classifier=True, seeds=2), first,
                                second, classifier=True, seeds=2)
    for name in ("separation_power", "auc_high"):
        assert got[f"{name}_floor"] is not None and got[f"{name}_ratio"] > 1.5, (name, got)
    # a floor 0 within its error: the distance from it in σ, never a ratio to it
    for name in ("fpd", "kpd"):
        assert got[f"{name}_floor_error"] > 0 and f"{name}_ratio" not in got, (name, got)
        assert got[f"{name}_sigma"] == pytest.approx(
            (got[name] - got[f"{name}_floor"])
            / math.hypot(got[f"{name}_error"], got[f"{name}_floor_error"]))
    # 600 events a side: FPD's error (its fit's, and the samples' own spread) is the limit
    assert got["fpd_sigma"] > 1 and got["kpd_sigma"] > 1, got
    assert got["separation_power_features"]["centre_x"]["floor"] > 0


def test_one_name_everywhere_and_a_short_line():
    from mpilearn.calo.callbacks import record_name, short_line
    from mpilearn.calo.gan import GANProtocol

    # validate's names are the epoch record's for every floored number; terms are physics_*
    assert [record_name(k) for k in ("sampling_fraction_mre_ratio", "fpd_error", "auc_high",
                                     "moments", "events")] == [
        "sampling_fraction_mre_ratio", "fpd_error", "auc_high", "physics_moments", "physics_events"]
    result = {"score": 0.41234, "score_ratio": 3.2, "sampling_fraction_mre": 0.05,
              "sampling_fraction_mre_ratio": 2.0, "fpd": 83.45, "fpd_sigma": 3712.0,
              "fpd_floor": 0.0, "fpd_floor_error": 0.022, "kpd": 0.001, "kpd_sigma": None,
              "moments": 0.1, "profiles": 0.2, "reference_metric": 7.0}
    line = GANProtocol.test_summary(result)
    assert line == ("score 0.4123 (3.2x floor), sampling_fraction_mre 0.05 (2x floor), "
                    "fpd 83.45 (3 700 σ; MC floor 0.0000 ± 0.022), kpd 0.001")
    assert short_line(result) == line
    # validate's lines say the same
    from mpilearn.calo.validate import sigma_verdict

    assert sigma_verdict(result, "fpd") == "3 700 σ above the MC floor 0.0000 ± 0.022 (far off)"
    assert sigma_verdict({**result, "fpd_sigma": 1.25}, "fpd") == \
        "at the MC floor (1.2 σ from 0.0000 ± 0.022)"


def test_a_floor_zero_within_its_error_gives_a_distance_in_sigma_never_a_ratio():
    floor = {"kpd": 0.002, "kpd_error": 0.003, "fpd": -0.0, "fpd_error": 0.004, "score": 0.1}
    # (value - floor) / sqrt(error^2 + floor_error^2); KPD's unbiased estimate can be below 0
    assert physics.floor_sigma("kpd", {"kpd": -0.002, "kpd_error": 0.004}, floor) == \
        pytest.approx(-0.8)
    assert physics.floor_sigma("fpd", {"fpd": 0.015, "fpd_error": 0.003}, floor) == \
        pytest.approx(3.0)
    assert physics.floor_ratio("fpd", {"fpd": 0.015}, floor) is None
    assert physics.floor_ratio("score", {"score": 0.3}, floor) == pytest.approx(3.0)
    assert physics.floor_sigma("kpd", {"kpd": None}, floor) is None
    assert physics.floor_sigma("kpd", {"kpd": 0.01}, floor) is None   # no error: no σ


@pytest.mark.unit
def test_the_verdict_places_an_auc_among_the_published_entries_and_lists_their_points():
    from mpilearn.calo.published import POINTS, place
    from mpilearn.calo.validate import verdicts

    # the challenge's dataset-2 files: Geant4 against itself ~0.5, the best entry below the GANs
    for name in ("auc_high", "auc_low"):
        geant4, (_, best), gans = POINTS[name]
        assert abs(geant4 - 0.5) < 0.01 and best < min(v for _, v in gans)
    assert place("auc_high", 0.51).startswith("as hard to tell as the best published entry")
    assert place("auc_high", 0.80).startswith("between the best published entry (0.521)")
    assert place("auc_high", 0.95).startswith("as easy to tell as the published GANs (0.927+)")
    assert place("fpd", 0.01) is None  # a distance on other features: no placement
    result = {"events": 2000, "fpd": 0.5, "fpd_sigma": 40.0, "fpd_floor": 0.0,
              "fpd_floor_error": 0.01, "auc_high": 0.8, "auc_high_floor": 0.51,
              "auc_high_ratio": 1.6}
    lines = verdicts(result)
    classifiers = next(line for line in lines if "the CaloChallenge classifiers:" in line)
    assert "between the best published entry" in classifiers
    published = lines[lines.index(next(l for l in lines if "published reference points" in l)):]
    assert [line.split(":")[0].strip() for line in published[1:]] == ["fpd", "auc_high"]
    assert "the best entry 0.0246 (CaloDREAM)" in published[1]
    assert "the GANs DeepTree 0.927, MDMA 0.987" in published[2]
    assert not [l for l in verdicts({"events": 10, "score": 1.0, "score_floor": 1.0,
                                     "score_ratio": 1.0}) if "published" in l]


def test_a_7_percent_energy_scale_error_is_flagged_by_fpd_at_3_sigma_and_mc_is_not():
    """validate's defaults (FPD's batches and fit, pairing by conditions, the floor from a
    disjoint MC sample): 1 250 showers a side, MC A against MC B for the floor; an independent
    MC C, once as it is and once 7 % too hot (the energy scale only, no shift)."""
    def draw(seed, n=1250, scale=1.0):
        rng = np.random.default_rng(seed)
        energy = rng.uniform(100, 200, n)
        theta = rng.uniform(math.radians(60), math.radians(120), n)
        parts = [physics.features(scale * showers(energy[i:i + 250], theta[i:i + 250],
                                                  (51, 51, 25), rng), energy[i:i + 250],
                                  theta[i:i + 250]) for i in range(0, n, 250)]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    a, b = draw(11), draw(12)
    floor = physics.pair_by_conditions(a, b)
    for scale, flagged in ((1.0, False), (1.07, True)):
        compared = physics.pair_by_conditions(a, draw(13, scale=scale))
        got, _ = physics.with_floor(physics.score(*compared), *floor)
        assert (got["fpd_sigma"] >= 3) == flagged, (scale, got["fpd"], got["fpd_error"],
                                                     got["fpd_floor"], got["fpd_floor_error"])
