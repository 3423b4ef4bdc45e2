"""mpilearn.tensorflow as the horovod.tensorflow drop-in, under real mpirun: every collective
against numpy (eager and inside tf.function, with gradients), DistributedGradientTape,
broadcast_variables, process sets and mismatches; and Horovod's own TF2 examples, ported by
the import line and the Keras 3 edits, on 2 ranks."""
import os
import subprocess
import sys

import pytest

from conftest import ENV, REPO, TESTS, mpirun

SCRIPTS = os.path.join(TESTS, "scripts")
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}

# the public names of horovod.tensorflow 0.28.1 (its __init__), TensorFlow 2 only
HOROVOD_TENSORFLOW = """init shutdown is_initialized start_timeline stop_timeline size local_size
cross_size rank local_rank cross_rank is_homogeneous rank_op local_rank_op size_op
local_size_op process_set_included_op mpi_threads_supported mpi_enabled mpi_built gloo_enabled
gloo_built nccl_built ddl_built ccl_built cuda_built rocm_built ProcessSet global_process_set
add_process_set remove_process_set Average Sum Adasum Min Max Product Compression allreduce
grouped_allreduce allgather grouped_allgather broadcast broadcast_ alltoall reducescatter
grouped_reducescatter join barrier broadcast_object allgather_object broadcast_variables
broadcast_global_variables DistributedOptimizer DistributedGradientTape""".split()


def ok_lines(proc):
    return [line for line in proc.stdout.splitlines() if line.startswith("ok ")]


def test_every_horovod_tensorflow_name_exists():
    code = ("import mpilearn.tensorflow as hvd; "
            f"missing = [n for n in {HOROVOD_TENSORFLOW!r} if not hasattr(hvd, n)]; "
            "print(missing); assert not missing")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**ENV, **TF_ENV}, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


@pytest.mark.parametrize("n", [1, 2, 4])  # np=3 passes too; left out for CI time
def test_tf_collectives_against_numpy_eager_and_graph(n):
    proc = mpirun(n, [f"{SCRIPTS}/hvd_tf_collectives.py"], env=TF_ENV, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(ok_lines(proc)) == 11 * n, proc.stdout


EXAMPLES = os.path.join(SCRIPTS, "horovod_examples")
SMALL = {"MPILEARN_EXAMPLE_IMAGES": "512", "MPILEARN_EXAMPLE_STEPS": "24",
         "MPILEARN_EXAMPLE_BATCH": "32", "MPILEARN_EXAMPLE_EPOCHS": "2"}
BENCH = ["--model", "MobileNetV3Small", "--batch-size", "2", "--num-batches-per-iter", "2",
         "--num-iters", "2", "--no-cuda"]


def test_horovod_tf2_mnist_custom_loop(tmp_path):
    proc = mpirun(2, [f"{EXAMPLES}/tensorflow2_mnist.py"], cwd=tmp_path, env={**TF_ENV, **SMALL})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Step #10" in proc.stdout and (tmp_path / "checkpoints-1.index").exists()


def test_horovod_tf2_keras_mnist(tmp_path):
    proc = mpirun(2, [f"{EXAMPLES}/tensorflow2_keras_mnist.py"], cwd=tmp_path,
                  env={**TF_ENV, **SMALL, "MPILEARN_EXAMPLE_STEPS": "12"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "checkpoint-2.keras").exists()


@pytest.mark.parametrize("script,extra", [
    ("tensorflow2_synthetic_benchmark.py", ["--num-warmup-batches", "1"]),
    ("tensorflow2_synthetic_benchmark.py", ["--num-warmup-batches", "1", "--fp16-allreduce"]),
    ("tensorflow2_keras_synthetic_benchmark.py", [])])
def test_horovod_tf2_synthetic_benchmarks(tmp_path, script, extra):
    proc = mpirun(2, [f"{EXAMPLES}/{script}"] + BENCH + extra, cwd=tmp_path, env=TF_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Total img/sec on 2 CPU(s)" in proc.stdout, proc.stdout[-2000:]
