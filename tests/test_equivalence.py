"""N ranks x local batch b == 1 rank x batch N*b, for every backend on this machine."""
import numpy as np
import pytest

from mpilearn.allreduce import available_backends

from conftest import TESTS, mpirun, shared

SCRIPT = f"{TESTS}/scripts/equivalence.py"
STEPS, B = 6, 4


def weights(path):
    data = np.load(path)
    return [data[k] for k in sorted(data.files, key=lambda s: int(s.split("_")[1]))]


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Single-process runs with the global batch, one per (optimizer, N), and the weights
    after zero steps, one per optimizer; run once per session, shared read-only."""
    cases = [(opt, n) for opt in ("sgd", "adam") for n in (0, 2, 4)]  # n=0: no step

    def run(folder):
        for opt, n in cases:
            batch, steps = (B, 0) if n == 0 else (B * n, STEPS)
            proc = mpirun(1, [SCRIPT, "mpi", opt, str(batch), str(steps), str(folder / f"{opt}-{n}.npz")])
            assert proc.returncode == 0, proc.stderr

    folder = shared(tmp_path_factory, "equivalence-reference", run)
    return {(opt, n): weights(str(folder / f"{opt}-{n}.npz")) for opt, n in cases}


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("n", [2, 4])
def test_distributed_equals_single_process(reference, tmp_path, backend, opt, n):
    path = str(tmp_path / "w.npz")
    proc = mpirun(n, [SCRIPT, backend, opt, str(B), str(STEPS), path])
    assert proc.returncode == 0, proc.stderr
    got, want = weights(path), reference[opt, n]
    # the weights moved: otherwise equality would prove nothing
    start = reference[opt, 0]
    assert any(not np.allclose(g, s) for g, s in zip(got, start))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
