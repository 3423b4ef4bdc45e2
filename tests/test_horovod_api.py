"""mpilearn.torch / mpilearn.keras as Horovod drop-ins, under real mpirun (np = 2, 3, 4):
every collective against numpy, errors on every rank, optimizer semantics, ported Horovod
scripts against a single process, value-by-value agreement with Horovod itself where it is
installed, and the launchers."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ENV, REPO, TESTS, mpirun

SCRIPTS = os.path.join(TESTS, "scripts")
KERAS_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}

# the public names of horovod.torch 0.28 (its __init__), and of horovod.tensorflow.keras
HOROVOD_TORCH = """allgather_object broadcast_object broadcast_optimizer_state broadcast_parameters
allreduce allreduce_async allreduce_ allreduce_async_ grouped_allreduce grouped_allreduce_async
grouped_allreduce_ grouped_allreduce_async_ allgather allgather_async grouped_allgather
grouped_allgather_async broadcast broadcast_async broadcast_ broadcast_async_ alltoall
alltoall_async reducescatter reducescatter_async grouped_reducescatter
grouped_reducescatter_async join barrier poll synchronize init shutdown is_initialized
start_timeline stop_timeline size local_size cross_size rank local_rank cross_rank
is_homogeneous mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built
ddl_built ccl_built cuda_built rocm_built ProcessSet global_process_set add_process_set
remove_process_set Average Sum Adasum Min Max Product HorovodInternalError DistributedOptimizer
SyncBatchNorm Compression""".split()
HOROVOD_KERAS = """init shutdown is_initialized size local_size cross_size rank local_rank
cross_rank is_homogeneous mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built
nccl_built ddl_built ccl_built cuda_built rocm_built ProcessSet global_process_set
add_process_set remove_process_set Average Sum Adasum Min Max Product Compression
DistributedOptimizer allreduce grouped_allreduce allgather grouped_allgather broadcast alltoall
reducescatter grouped_reducescatter broadcast_object allgather_object join barrier
broadcast_variables broadcast_global_variables load_model callbacks""".split()
KERAS_CALLBACKS = """BroadcastGlobalVariablesCallback MetricAverageCallback LearningRateWarmupCallback
LearningRateScheduleCallback BestModelCheckpoint""".split()


def ok_lines(proc):
    return [line for line in proc.stdout.splitlines() if line.startswith("ok ")]


def test_every_horovod_name_exists():
    import mpilearn.torch as hvd

    assert [n for n in HOROVOD_TORCH if not hasattr(hvd, n)] == []
    fresh = subprocess.run(  # a fresh process: other tests here may have initialised
        [sys.executable, "-c", "import mpilearn.torch as hvd; assert not hvd.is_initialized()\n"
         "try:\n    hvd.rank()\nexcept ValueError as e:\n    print(e)"],
        capture_output=True, text=True, env=ENV, timeout=120)
    assert "Horovod has not been initialized; use hvd.init()." in fresh.stdout, fresh.stderr
    assert hvd.Average == 0 and hvd.Sum == 1 and hvd.Adasum == 2  # Horovod's op values
    assert (hvd.Min, hvd.Max, hvd.Product) == (3, 4, 5)
    assert issubclass(hvd.HorovodInternalError, RuntimeError)


def test_every_keras_name_exists():
    code = ("import mpilearn.tensorflow.keras as hvd, mpilearn.keras as k; "
            "import mpilearn.tensorflow.keras.callbacks as cb; "
            f"missing = [n for n in {HOROVOD_KERAS!r} if not hasattr(hvd, n)]; "
            f"missing += [n for n in {KERAS_CALLBACKS!r} if not hasattr(hvd.callbacks, n)]; "
            "assert hvd.DistributedOptimizer is k.DistributedOptimizer; print(missing)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**ENV, **KERAS_ENV}, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_collectives_single_process():
    proc = subprocess.run([sys.executable, f"{SCRIPTS}/hvd_collectives.py"], capture_output=True,
                          text=True, env=ENV, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(ok_lines(proc)) == 11


@pytest.mark.parametrize("n", [2, 3, 4])
def test_collectives_against_numpy(n):
    proc = mpirun(n, [f"{SCRIPTS}/hvd_collectives.py"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(ok_lines(proc)) == 13 * n


@pytest.mark.parametrize("n", [2, 3])
def test_mismatches_raise_on_every_rank_within_seconds(n):
    proc = mpirun(n, [f"{SCRIPTS}/hvd_errors.py"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = [line for line in ok_lines(proc) if line.split()[-1][0].isdigit()]
    assert len(cases) == 13 * n  # every case raised on every rank
    assert max(float(line.split()[-1]) for line in cases) < 10
    assert proc.stdout.count("ok duplicate name") == n and proc.stdout.count("ok local errors") == n


@pytest.mark.parametrize("n", [2, 3])
def test_optimizer_semantics_and_sync_batch_norm(n):
    proc = mpirun(n, [f"{SCRIPTS}/hvd_optimizer.py"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(ok_lines(proc)) == 6 * n


def test_ported_pytorch_mnist_trains_like_one_process(tmp_path):
    script = f"{SCRIPTS}/examples/torch_classifier.py"
    two = mpirun(2, [script, "--batch-size", "32", "--save", str(tmp_path / "two.pt"),
                     "--fp16-allreduce", "--gradient-predivide-factor", "2"], timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    exact = mpirun(2, [script, "--batch-size", "32", "--float64", "--save",
                       str(tmp_path / "exact.pt")], timeout=300)
    assert exact.returncode == 0, exact.stderr[-3000:]
    for name, extra in (("one", []), ("one64", ["--float64"])):
        one = subprocess.run([sys.executable, script, "--batch-size", "64", "--lr", "0.02",
                              "--save", str(tmp_path / f"{name}.pt"), *extra], capture_output=True,
                             text=True, env=ENV, cwd=REPO, timeout=300)
        assert one.returncode == 0, one.stderr
    # float64: equal up to summation order; fp16 on the wire (float32 run): a looser bound
    for name, base, tol in (("exact", "one64", 1e-9), ("two", "one", 1e-2)):
        ref = torch.load(tmp_path / f"{base}.pt")
        got = torch.load(tmp_path / f"{name}.pt")
        for k in ref:
            rel = ((got[k] - ref[k]).abs().max() / ref[k].abs().max()).item()
            assert rel < tol, (name, k, rel)
    assert "epoch 1 held-out loss" in two.stdout


def test_ported_tf2_keras_fit_trains_like_one_process(tmp_path):
    script = f"{SCRIPTS}/examples/keras_fit.py"
    two = mpirun(2, [script, "--shard", "--batch-size", "16", "--save-weights",
                     str(tmp_path / "two.npz"), "--checkpoint-dir", str(tmp_path)],
                 timeout=300, env=KERAS_ENV)
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run([sys.executable, script, "--shard", "--batch-size", "32",
                          "--lr", "0.002", "--save-weights", str(tmp_path / "one.npz")],
                         capture_output=True, text=True, env={**ENV, **KERAS_ENV}, cwd=REPO,
                         timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    a, b = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-4)
    for k in a.files:
        if k != "loss":
            assert np.abs(a[k] - b[k]).max() <= 1e-4 * np.abs(a[k]).max(), k
    assert (tmp_path / "epoch-2.keras").exists()  # rank 0's ModelCheckpoint


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_keras_collectives_callbacks_and_accumulation(backend, tmp_path):
    proc = mpirun(2, [f"{SCRIPTS}/hvd_keras_api.py", str(tmp_path)], timeout=300,
                  env={**KERAS_ENV, "KERAS_BACKEND": backend})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(ok_lines(proc)) == 4 * 2


def _horovod_installed() -> bool:
    proc = subprocess.run([sys.executable, "-c", "import horovod.torch"], capture_output=True,
                          env=ENV, timeout=120)
    return proc.returncode == 0


def test_same_values_as_horovod_itself(tmp_path):
    """The same calls under Horovod 0.28.1 (built by `make horovod`, a prerequisite of
    `make test`) and under mpilearn give the same values on every rank."""
    if not _horovod_installed():
        pytest.fail("Horovod is not installed: run `make horovod` (make test builds it)")
    for lib in ("horovod.torch", "mpilearn.torch"):
        proc = mpirun(3, [f"{SCRIPTS}/hvd_crosscheck.py", lib, str(tmp_path / lib)], timeout=300,
                      env={"HOROVOD_CYCLE_TIME": "1"})
        assert proc.returncode == 0, (lib, proc.stderr[-3000:])
    for r in range(3):
        theirs = np.load(tmp_path / f"horovod.torch.{r}.npz")
        ours = np.load(tmp_path / f"mpilearn.torch.{r}.npz")
        assert sorted(theirs.files) == sorted(ours.files)
        for k in theirs.files:
            a, b = theirs[k], ours[k]
            if a.dtype.kind in "US":
                assert str(a) == str(b), k
                continue
            # fp16: Horovod rounds after each pairwise reduction, we once after a float32 sum
            fp16 = "half" in k or "fp16" in k
            np.testing.assert_allclose(b, a, rtol=5e-3 if fp16 else 1e-9,
                                       atol=5e-3 if fp16 else 1e-12, err_msg=f"rank {r} {k}")


def test_torchrun_is_refused_with_the_fix(toy_file, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "2",
         "-m", "mpilearn.train", "--no-progress", "--set", f"model={REPO}/models/mlp.py",
         "--set", f"data.files=[{toy_file}]", "--output", str(out)],
        capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.count("torchrun started 2 processes") == 1, proc.stderr[-2000:]
    assert "mpirun -np 2" in proc.stderr and "exitcode  : 2" in proc.stderr
    assert not out.exists()  # nothing written, twice or at all


def test_hvd_init_under_torchrun_raises():
    code = "import mpilearn.torch as hvd; hvd.init()"
    env = {**ENV, "TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "2"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode != 0 and "ValueError: torchrun started 2 processes" in proc.stderr


def test_mpilearn_run_builds_the_launch_command(tmp_path):
    from mpilearn.cluster.run import build_command, parse_hosts, read_hostfile

    hosts = parse_hosts("host1:2,host2:2")
    cmd = build_command(4, hosts, ["python", "train.py"], env={"PATH": "/x"}, flavour="openmpi")
    assert cmd[:3] == ["mpirun", "-np", "4"] and "-H" in cmd and "host1:2,host2:2" in cmd
    assert cmd[-2:] == ["python", "train.py"] and ["-x", "PATH"] == cmd[cmd.index("-x"):][:2]
    hydra = build_command(4, hosts, ["python", "t.py"], env={}, flavour="hydra")
    assert hydra[:3] == ["mpirun", "-n", "4"] and "-hosts" in hydra
    srun = build_command(8, None, ["python", "t.py"], env={"SLURM_JOB_ID": "5"})
    assert srun[:2] == ["srun", "--ntasks=8"]
    (tmp_path / "hosts").write_text("# two nodes\nnode1 slots=4\nnode2:2\n")
    assert read_hostfile(str(tmp_path / "hosts")) == [("node1", 4), ("node2", 2)]
    with pytest.raises(ValueError, match="only 6 slots"):
        build_command(8, read_hostfile(str(tmp_path / "hosts")), ["python"], env={})


def test_mpilearn_run_runs_a_horovod_style_script():
    proc = subprocess.run(
        [sys.executable, "-m", "mpilearn.run", "-np", "2", sys.executable, "-c",
         "import mpilearn.torch as hvd, torch; hvd.init(); "
         "print('sum', hvd.allreduce(torch.ones(1), op=hvd.Sum).item())"],
        capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("sum 2.0") == 2
    assert proc.stderr.startswith("mpilearn-run: mpirun -np 2")
    bad = subprocess.run([sys.executable, "-m", "mpilearn.run", "-np", "2", "-H", "a:1",
                          "python"], capture_output=True, text=True, env=ENV, timeout=60)
    assert bad.returncode == 2 and "only 1 slots" in bad.stderr


def test_timeline_is_a_chrome_trace_of_each_collective(tmp_path):
    path = tmp_path / "timeline.json"
    code = ("import torch, mpilearn.torch as hvd; hvd.init(); "
            f"hvd.start_timeline({str(path)!r}, mark_cycles=True); "
            "hvd.allreduce(torch.ones(3), name='grad'); hvd.allgather(torch.ones(2)); "
            "hvd.stop_timeline()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    import json
    events = json.loads(path.read_text())
    phases = [(e.get("tid"), e["name"], e["ph"]) for e in events if "tid" in e]
    assert phases[:4] == [("allreduce.grad", "NEGOTIATE_ALLREDUCE", "B"),
                          ("allreduce.grad", "NEGOTIATE_ALLREDUCE", "E"),
                          ("allreduce.grad", "ALLREDUCE", "B"), ("allreduce.grad", "ALLREDUCE", "E")]
    assert ("allgather.noname", "ALLGATHER", "E") in phases
    assert sum(e["name"] == "CYCLE_START" for e in events) == 2
    assert "start_time_since_epoch_in_micros" in events[0]["args"]
