"""The GPU path, on a CUDA machine: device binding, NCCL (one rank per GPU, a clear refusal of
a shared one), MPI with host staging, the Horovod API on CUDA tensors, the engine on CUDA
(exact np=2 vs np=1 GAN, kill -9 and resume, bf16 autocast), and Keras on the torch backend.

Every test here needs a CUDA GPU and skips, saying so, where none is visible. Multi-rank runs
share the one GPU of a test machine through the mpi backend (MPILEARN_ALLOW_SHARED_GPUS=1);
the rest of the suite, run with the GPU visible, trains on it too (device.type auto).
"""
import json
import os

import numpy as np
import pytest
import torch

from conftest import REPO, TESTS, kill9_after_mid_epoch_checkpoint, mpirun, train_args
from mpilearn.train import checkpoint as ckpt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU and none is visible: GPU tests did NOT run (pytest -m gpu on a GPU node)")]

SHARED = {"MPILEARN_ALLOW_SHARED_GPUS": "1"}
EQUIV = f"{TESTS}/scripts/equivalence.py"


def npz(path):
    data = np.load(path)
    return [data[k] for k in sorted(data.files, key=lambda s: int(s.split("_")[1]))]


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_mpi_staged_two_ranks_on_cuda_equal_one_rank(tmp_path, opt):
    one, two, cpu = (str(tmp_path / f"{n}.npz") for n in ("one", "two", "cpu"))
    for np_, backend, batch, out, device in ((1, "mpi", 8, one, "cuda"), (2, "mpi", 4, two, "cuda"),
                                             (1, "mpi", 8, cpu, "cpu")):
        proc = mpirun(np_, [EQUIV, backend, opt, str(batch), "6", out, device], env=SHARED)
        assert proc.returncode == 0, proc.stderr[-3000:]
    for a, b, c in zip(npz(one), npz(two), npz(cpu)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)   # distributed == single, on GPU
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-6)   # GPU == CPU arithmetic


def test_nccl_one_rank_per_gpu_equals_mpi(tmp_path):
    nccl, mpi = str(tmp_path / "nccl.npz"), str(tmp_path / "mpi.npz")
    for backend, out in (("torch", nccl), ("mpi", mpi)):
        proc = mpirun(1, [EQUIV, backend, "adam", "8", "6", out, "cuda"])
        assert proc.returncode == 0, proc.stderr[-3000:]
    for a, b in zip(npz(nccl), npz(mpi)):
        np.testing.assert_array_equal(a, b)


def test_nccl_refuses_two_ranks_on_one_gpu(tmp_path, toy_file):
    api = mpirun(2, [EQUIV, "torch", "sgd", "4", "2", str(tmp_path / "x.npz"), "cuda"], timeout=120)
    assert api.returncode != 0
    assert "cannot share a GPU between ranks, but ranks 0, 1 all use cuda:0" in api.stderr
    cli = mpirun(2, train_args("--set", f"model={REPO}/models/mlp.py",
                               "--set", f"data.files=[{toy_file}]", "--set", "train.backend=torch",
                               "--set", "device.type=cuda", "--set", "device.allow_shared_gpus=true",
                               "--output", str(tmp_path / "run")), timeout=120)
    assert cli.returncode == 2, cli.stderr[-2000:]
    assert cli.stderr.count("uses NCCL, which cannot run two ranks on one GPU") == 1


def test_mpi_reports_cuda_awareness():
    code = ("from mpi4py import MPI; from mpilearn.allreduce.mpi import cuda_aware; "
            "q = getattr(MPI, 'Query_cuda_support', None); "
            "print('query', None if q is None else bool(q()), 'aware', cuda_aware())")
    proc = mpirun(1, ["-c", code])
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    assert words[0] == "query" and words[2] == "aware"
    assert words[3] == ("True" if words[1] == "True" else "False")
    print(proc.stdout)  # shown with -s: the report for RESULTS.md


def test_mpi_staging_keeps_float64_on_cuda():
    """Host staging (an MPI without CUDA support) sums a float64 CUDA tensor in float64: 1e-12
    apart from 1 is lost in float32 (the noise scale's sums and float64 runs travel this way)."""
    code = ("import torch; from mpi4py import MPI; from mpilearn.allreduce.mpi import MPIBackend; "
            "b = MPIBackend(MPI.COMM_WORLD); x = torch.full((3,), 1 + 1e-12, dtype=torch.float64, "
            "device='cuda'); b.wait(b.allreduce_async(x)); "
            "print('sum', repr((x - 2).max().item()), x.dtype, x.device)")
    proc = mpirun(2, ["-c", code], env=SHARED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in (l for l in proc.stdout.splitlines() if l.startswith("sum ")):
        _, err, dtype, device = line.split()
        assert abs(float(err) - 2e-12) < 1e-15 and dtype == "torch.float64" and device.startswith("cuda"), line


@pytest.mark.parametrize("n", [2, 3])
def test_horovod_collectives_on_cuda_tensors(n):
    proc = mpirun(n, [f"{TESTS}/scripts/hvd_collectives.py"], env={"MPILEARN_TEST_DEVICE": "cuda"},
                  timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ok allreduce" in proc.stdout


def test_ported_horovod_mnist_runs_on_cuda(tmp_path):
    script = f"{TESTS}/scripts/examples/torch_classifier.py"
    gpu = mpirun(2, [script, "--epochs", "1", "--save", str(tmp_path / "gpu.pt")], env=SHARED)
    cpu = mpirun(2, [script, "--epochs", "1", "--no-cuda", "--save", str(tmp_path / "cpu.pt")])
    assert gpu.returncode == 0 and cpu.returncode == 0, gpu.stderr[-2000:] + cpu.stderr[-2000:]
    a, b = torch.load(tmp_path / "gpu.pt"), torch.load(tmp_path / "cpu.pt")
    for k in a:  # same training on the GPU as on the CPU, up to float32 arithmetic
        rel = ((a[k] - b[k]).abs().max() / b[k].abs().max()).item()
        assert rel < 1e-3, (k, rel)


def _gan(np_, folder, out, batch, *sets):
    extra = [x for s in sets for x in ("--set", s)]
    return mpirun(np_, train_args(
        "--set", f"model={REPO}/models/gan3d.py", "--set", f"data.files=[{folder}/*.h5]",
        "--set", "data.val_fraction=0.2", "--set", "hparams.preset=small",
        "--set", f"train.batch_size={batch}", "--set", "train.max_steps_per_epoch=3",
        "--set", "device.type=cuda", *extra, "--output", str(out)), timeout=600, env=SHARED)


def test_gan_two_ranks_on_cuda_equal_one_rank(showers_dir, tmp_path):
    exact = ["hparams.batch_norm=false", "hparams.dropout=0.0", "hparams.dtype=float64"]
    one = _gan(1, showers_dir, tmp_path / "one", 8, *exact)
    two = _gan(2, showers_dir, tmp_path / "two", 4, *exact)
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    assert "on cuda:0 x2" in two.stdout
    a = ckpt.load(ckpt.latest(str(tmp_path / "one" / "checkpoints")))["task"]["models"]
    b = ckpt.load(ckpt.latest(str(tmp_path / "two" / "checkpoints")))["task"]["models"]
    # Not bitwise as on the CPU: cuDNN autotunes per shape (batch 8 vs 4) and 3-D pooling's
    # backward adds atomically, and RMSprop's first steps (g / sqrt(v)) amplify those last
    # bits. Measured on an H100: 0.5 % of the weights off by at most 1.4e-7 (the weights are
    # ~1e-2; one update moves them by ~3e-3, so a protocol error shows far above this bound).
    for net in a:
        for k in a[net]:
            np.testing.assert_allclose(b[net][k].numpy(), a[net][k].numpy(), rtol=1e-5, atol=1e-6)


def test_bf16_autocast_trains_close_to_fp32(showers_dir, tmp_path):
    runs = {}
    for precision in ("fp32", "bf16"):
        proc = _gan(1, showers_dir, tmp_path / precision, 8, f"train.precision={precision}",
                    "hparams.dropout=0.0")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"precision {precision}" in proc.stdout
        runs[precision] = json.loads(open(tmp_path / precision / "metrics.jsonl").readline())
    for key in ("train_d_loss", "train_g_loss"):
        assert np.isfinite(runs["bf16"][key])
        assert runs["bf16"][key] == pytest.approx(runs["fp32"][key], rel=0.15), key
    assert (tmp_path / "bf16" / "models" / "generator.safetensors").exists()


def test_kill9_and_resume_on_cuda_matches_uninterrupted(toy_file, tmp_path):
    def args(out):
        return train_args("--set", f"model={TESTS}/models/slow.py", "--set", f"data.files=[{toy_file}]",
                          "--set", "train.epochs=3", "--set", "train.batch_size=16",
                          "--set", "train.checkpoint_every_steps=4", "--set", "train.deterministic=true",
                          "--set", "hparams.sleep=0.04", "--set", "device.type=cuda", "--output", out)

    whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
    proc = mpirun(2, args(whole), env=SHARED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on cuda:0 x2" in proc.stdout
    kill9_after_mid_epoch_checkpoint(2, args(cut), cut, env=SHARED)
    proc = mpirun(2, args(cut) + ["--resume"], env=SHARED)
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    got = ckpt.load(ckpt.latest(os.path.join(cut, "checkpoints")))["task"]["models"]["model"]
    want = ckpt.load(ckpt.latest(os.path.join(whole, "checkpoints")))["task"]["models"]["model"]
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["loop", "fit"])
def test_keras_torch_backend_on_cuda_two_ranks_equal_one(tmp_path, mode):
    env = {"KERAS_BACKEND": "torch", **SHARED}
    one, two = str(tmp_path / "one.npz"), str(tmp_path / "two.npz")
    p1 = mpirun(1, [f"{TESTS}/scripts/keras_equivalence.py", mode, "8", "6", one], env=env)
    p2 = mpirun(2, [f"{TESTS}/scripts/keras_equivalence.py", mode, "4", "6", two], env=env)
    assert p1.returncode == 0 and p2.returncode == 0, p1.stderr[-2000:] + p2.stderr[-2000:]
    assert "variables on cuda" in p2.stdout
    a, b = np.load(one), np.load(two)
    for k in a.files:
        np.testing.assert_allclose(b[k], a[k], rtol=2e-5, atol=2e-6)


def test_compiled_channels_last_gan_on_cuda_follow_eager(tmp_path):
    """train.compile and channels_last_3d on CUDA, 2 ranks sharing the GPU: the small 3DGAN
    in float64 follows eager, and its buckets start from backward's hooks."""
    out = str(tmp_path / "r.npz")
    proc = mpirun(2, [f"{TESTS}/scripts/compiled_step.py", "gan", "4", "2", out, "cuda"],
                  env=SHARED, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = np.load(out)
    d = {k: data[k] for k in data.files}
    for variant in ("compiled", "channels_last"):
        for k in (k for k in d if k.startswith("eager/") and k.count("/") == 2):
            want, got = d[k], d[k.replace("eager/", variant + "/", 1)]
            assert np.abs(got - want).max() <= 1e-4 * max(np.abs(want).max(), 1e-12), (variant, k)
        np.testing.assert_allclose(d[f"{variant}/losses"][0], d["eager/losses"][0], rtol=1e-8)
        assert d[f"{variant}/overlapped"] >= 8 and not d[f"{variant}/prefixed"]


def test_one_host_read_per_gan_batch_on_cuda():
    """The four updates' finite flags and losses leave the GPU in one read, and no
    .item()/bool() on a CUDA tensor happens in the step."""
    import sys

    from mpilearn.calo.format import Preprocess
    from mpilearn.train import guard

    sys.path.insert(0, os.path.join(REPO, "models"))
    import gan3d

    class CudaScalarReads(torch.utils._python_dispatch.TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default and args[0].is_cuda:
                type(self).count += 1
            return func(*args, **(kwargs or {}))

    rng = np.random.default_rng(0)
    batch = Preprocess("angle")({"ECAL": rng.random((16, 51, 51, 25), dtype=np.float32),
                                 "energy": rng.uniform(100, 200, 16), "mtheta": rng.uniform(1.0, 2.1, 16),
                                 "_index": np.arange(16)})
    task = gan3d.build({"preset": "small"})
    task.setup(None, "cuda:0", "mpi", 1 << 20, distributed=False)
    task.train_step(batch)
    before = guard.READS["count"]
    with CudaScalarReads():
        task.train_step(batch)
    assert guard.READS["count"] - before == 1 and CudaScalarReads.count == 0
