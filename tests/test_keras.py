"""Keras 3 through mpilearn.keras: N ranks x batch b equal 1 rank x batch N*b, in a custom
loop and under model.fit(), on the TensorFlow and the torch backends."""
import numpy as np
import pytest

from conftest import TESTS, mpirun

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
