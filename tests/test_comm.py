"""Device binding rules and the node-local split."""
import pytest

from mpilearn.core import comm
from mpilearn.core.comm import UsageError


class FakePlacement:
    """Only the placement numbers; the communicators themselves are real in other tests."""

    def __init__(self, local_rank, local_size):
        self.local_rank, self.local_size = local_rank, local_size


def test_one_gpu_per_local_rank():
    assert comm.choose_device(FakePlacement(3, 4), "auto", n_gpus=4) == "cuda:3"
    assert comm.choose_device(FakePlacement(1, 4), "auto", n_gpus=0) == "cpu"
    assert comm.choose_device(FakePlacement(1, 4), "cpu", n_gpus=4) == "cpu"


def test_more_ranks_than_gpus_says_which_flag_to_change():
    with pytest.raises(UsageError, match="ntasks-per-node=2"):
        comm.choose_device(FakePlacement(3, 4), "auto", n_gpus=2)
    assert comm.choose_device(FakePlacement(3, 4), "auto", allow_shared_gpus=True, n_gpus=2) == "cuda:1"
    with pytest.raises(UsageError, match="no CUDA device"):
        comm.choose_device(FakePlacement(0, 1), "cuda", n_gpus=0)


def test_nccl_never_shares_a_gpu_and_the_env_can_allow_sharing(monkeypatch):
    # NCCL fails (or hangs) with two ranks on one GPU: refused even with allow_shared_gpus
    with pytest.raises(UsageError, match="uses NCCL, which cannot run two ranks on one GPU"):
        comm.choose_device(FakePlacement(1, 2), "cuda", allow_shared_gpus=True, n_gpus=1,
                           backend="torch")
    assert comm.choose_device(FakePlacement(1, 2), "cuda", allow_shared_gpus=True, n_gpus=1,
                              backend="mpi") == "cuda:0"
    assert comm.choose_device(FakePlacement(1, 2), "cuda", n_gpus=2, backend="torch") == "cuda:1"
    monkeypatch.delenv("MPILEARN_ALLOW_SHARED_GPUS", raising=False)
    assert not comm.shared_gpus_from_env()
    monkeypatch.setenv("MPILEARN_ALLOW_SHARED_GPUS", "1")
    assert comm.shared_gpus_from_env()


def test_init_without_launcher():
    ctx = comm.init()
    assert (ctx.rank, ctx.size, ctx.local_rank, ctx.local_size) == (0, 1, 0, 1)


def test_per_task_gpus_use_their_own_device_zero():
    # srun --gpus-per-task=1: each rank sees one GPU, its own; not "4 ranks share 1 GPU"
    assert comm.choose_device(FakePlacement(3, 4), "auto", n_gpus=1, per_task=True) == "cuda:0"
