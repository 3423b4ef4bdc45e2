"""The gradient noise scale (mpilearn.allreduce.noise) against its closed form, and what the run
says about it: linear regression with Gaussian inputs and noise, held at a fixed point (lr 0),
has B_simple = ((d + 1)|a|² + d sigma²) / |a|² (tests/models/linreg.py)."""
import json

import h5py
import numpy as np
import pytest

from conftest import TESTS, mpirun, train_args

D, SIGMA, EVENTS = 8, 0.5, 16384


def closed_form(seed: int = 5) -> float:
    import sys

    sys.path.insert(0, f"{TESTS}/models")
    from linreg import offset

    a2 = float((offset(D, seed) ** 2).sum())
    return ((D + 1) * a2 + D * SIGMA ** 2) / a2


@pytest.fixture(scope="module")
def gaussian(tmp_path_factory):
    path = tmp_path_factory.mktemp("linreg") / "gauss.h5"
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["X"] = rng.normal(size=(EVENTS, D))
        f["y"] = SIGMA * rng.normal(size=EVENTS)
    return str(path)


def _train(np_, data, out, batch, *extra):
    proc = mpirun(np_, train_args(
        "--set", f"model={TESTS}/models/linreg.py", "--set", f"data.files=[{data}]",
        "--set", "data.val_fraction=0.01", "--set", f"train.batch_size={batch}",
        "--set", "train.noise_scale.halves_every=1", "--set", "train.best.monitor=none",
        "--output", str(out), *extra))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, [json.loads(line) for line in open(out / "metrics.jsonl")]


@pytest.mark.parametrize("np_,batch", [(1, 16), (2, 8)])
def test_noise_scale_matches_the_closed_form(gaussian, tmp_path, np_, batch):
    proc, records = _train(np_, gaussian, tmp_path / "run", batch)
    est = records[-1]["noise_scale"]["optimizer"]
    want = closed_form()
    assert est["b_simple"] == pytest.approx(want, rel=0.2), (est, want)
    assert est["b_simple_err"] < 0.2 * want  # the error says the estimate is this good
    assert est["critical_batch"] == est["b_simple"]  # SGD: the raw one governs
    assert est["global_batch"] == 16
    assert est["efficiency"] == pytest.approx(1 / (1 + 16 / est["b_simple"]))
    # the end-of-run line a user acts on, from rank 0 once
    line = [ln for ln in proc.stdout.splitlines() if "gradient noise scale" in ln]
    assert len(line) == 1, proc.stdout
    useful = max(1, round(est["b_simple"] / batch))
    assert f"optimizer: critical batch ≈ {est['b_simple']:.3g}" in line[0]
    assert f"at {batch} per rank" in line[0] and str(useful) in line[0]


@pytest.mark.parametrize("api,backend", [("torch", "torch"), ("keras", "torch"),
                                         ("keras", "tensorflow")])  # its compiled fit()
def test_the_horovod_apis_expose_it(api, backend):
    proc = mpirun(2, [f"{TESTS}/scripts/noise_scale_api.py", api],
                  env={"TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": backend})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    est = json.loads(proc.stdout.strip().splitlines()[-1])
    a2 = float((np.random.default_rng(5).normal(size=D) ** 2).sum())
    want = ((D + 1) * a2 + D * SIGMA ** 2) / a2
    assert est["b_simple"] == pytest.approx(want, rel=0.2), (est, want)
    assert est["global_batch"] == 16 and est["steps"] >= 50
    if api == "keras":  # the callback's log entry is the estimate
        assert est["logged"] == pytest.approx(est["critical_batch"])


def test_the_preconditioned_noise_scale_matches_its_closed_form(gaussian, tmp_path):
    """RMSprop at lr 0: its second moment settles at v_i = a_i² + Σ_ii / B (B = 16, the
    reduced batch), Σ = (|a|² + σ²) I + a aᵀ for Gaussian inputs, and the noise scale in its
    metric w = 1/√v is Σ w_i Σ_ii / Σ w_i a_i²; it governs RMSprop (critical_batch)."""
    import sys

    sys.path.insert(0, f"{TESTS}/models")
    from linreg import offset

    proc, records = _train(2, gaussian, tmp_path / "run", 8, "--set", "hparams.optimizer=rmsprop")
    est = records[-1]["noise_scale"]["optimizer"]
    a2 = offset(D, 5).numpy() ** 2
    diag = a2.sum() + SIGMA ** 2 + a2
    w = 1 / np.sqrt(a2 + diag / 16)
    want = float((w * diag).sum() / (w * a2).sum())
    assert est["b_pre"] == pytest.approx(want, rel=0.2), (est, want)
    assert est["preconditioned"] and est["critical_batch"] == est["b_pre"]
    assert est["b_simple"] == pytest.approx(closed_form(), rel=0.2)  # the raw one still holds
    assert "(preconditioned" in proc.stdout
