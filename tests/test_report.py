"""python -m mpilearn.report: the sweep plots read well (issue 48: integer block ticks, log
parameters with more than one labelled tick, no empty intermediate plot), and a training
run's report draws its curves, its physics against their floors, throughput and cost."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from mpilearn.hpo.report import draw_utilisation, log_axis  # noqa: E402


def labelled_ticks(ax):
    ax.figure.canvas.draw()
    lo, hi = sorted(ax.get_xlim())
    return [(t.get_loc(), t.label1.get_text()) for t in ax.xaxis.get_major_ticks()
            if t.label1.get_text() and lo <= t.get_loc() <= hi]


def test_one_block_gets_one_integer_tick_and_sensible_limits():
    fig, ax = plt.subplots()
    draw_utilisation(ax, {0: [(10.0, 12.0), (12.0, 15.0)]}, 0.9)
    assert list(ax.get_yticks()) == [0]  # not -0.4 ... 0.4
    assert sorted(ax.get_ylim()) == pytest.approx([-0.6, 0.6])
    fig, ax = plt.subplots()
    draw_utilisation(ax, {b: [(0.0, 1.0)] for b in range(3)}, 1.0)
    assert list(ax.get_yticks()) == [0, 1, 2]
    plt.close("all")


@pytest.mark.parametrize("low,high,at_least", [(1.0, 8.0, 3), (3.0, 8.0, 4), (1e-3, 0.1, 4),
                                               (1e-6, 1.0, 4)])
def test_a_log_parameter_axis_has_readable_ticks_over_its_range(low, high, at_least):
    """loss_weights.0 in [1, 8] had one labelled tick (10^0)."""
    fig, ax = plt.subplots()
    ax.scatter([low, (low * high) ** 0.5, high], [1, 2, 3])
    log_axis(ax, low, high)
    ticks = labelled_ticks(ax)
    assert len(ticks) >= at_least, ticks
    assert len(ticks) <= 12, ticks  # and not crowded
    assert all("10^" not in text and "$" not in text for _, text in ticks)  # plain numbers
    plt.close(fig)


def test_a_runs_physics_plot_takes_every_metric_with_a_floor(tmp_path):
    """The 3DGAN's score and the CaloChallenge's numbers (fpd, kpd, ...) alike: any X logged
    with X_floor is drawn against it, per epoch; a metric without a floor is not physics."""
    from mpilearn.train.report import floored_metrics, plots

    records = [{"epoch": e, "time": {}, "train_loss": 1.0 / e, "val_loss": 1.2 / e,
                "score": 10.0 / e, "score_floor": 0.3, "score_ratio": 10.0 / e / 0.3,
                "fpd": 0.5 / e, "fpd_floor": 0.01, "kpd": 0.02 / e, "kpd_floor": 1e-3,
                "auc_high": 0.9, "reference_metric": 4.0, "samples_per_s": 100.0 * e,
                "device_hours": 0.01, "device": "cpu"} for e in (1, 2, 3)]
    records[1].pop("fpd")  # validated every other epoch: the gap is left out
    assert floored_metrics(records) == ["fpd", "kpd", "score"]
    skipped = plots(str(tmp_path), records, {"in_epochs": {"cpu": 0.03}, "launched": None})
    assert skipped == {"noise_scale.png": skipped["noise_scale.png"]}  # none measured: said so
    assert "train.noise_scale" in skipped["noise_scale.png"]
    for r in records:  # the noise scale of each optimizer, as the engine logs it
        r["noise_scale"] = {d: {"b_simple": 40.0 * r["epoch"], "b_simple_err": 5.0,
                                "b_pre": 20.0 * r["epoch"], "b_pre_err": 3.0,
                                "global_batch": 32} for d in ("generator", "discriminator")}
    assert plots(str(tmp_path), records, {"in_epochs": {"cpu": 0.03}, "launched": None}) == {}
    for png in ("losses.png", "physics.png", "throughput.png", "cost.png", "noise_scale.png"):
        assert (tmp_path / png).stat().st_size > 5000
    skipped = plots(str(tmp_path), [{k: v for k, v in r.items() if "floor" not in k}
                                    for r in records], {"in_epochs": {}, "launched": None})
    assert "physics.png" in skipped and not (tmp_path / "physics.png").exists()
