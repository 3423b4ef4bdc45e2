"""Collects bench/results/*.md into bench/results/collected.md with the machine and versions: the
raw tables of one `make bench`, to move into the benchmark pages by topic (docs/benchmarks/, each
section with its command, machine and date; bench/RESULTS.md is their index)."""
import os
import platform
import subprocess
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RES = os.path.join(REPO, "bench", "results")
SECTIONS = [("throughput", "Data-parallel training throughput (np=1 and 2, same global batch)"),
            ("allreduce_cost_np2", "Allreduce cost per step vs one raw MPI_Allreduce of the same bytes (np=2)"),
            ("allreduce_cost_np4", "Allreduce cost per step vs one raw MPI_Allreduce of the same bytes (np=4)"),
            ("horovod_api", "Horovod API side by side with Horovod 0.28.1 (np=2)"),
            ("scaling", "Weak-scaling projection for the angle 3DGAN"),
            ("hpo_coordinator", "HPO coordinator: decision latency and block utilisation"),
            ("hpo_quality", "HPO quality vs Optuna TPE (sequential)"),
            ("hpo_parallel", "HPO under parallel load vs Optuna TPE and GP: quality, model share, cost at 1000 observations"),
            ("hpo_scale", "HPO at scale by simulation: 8 to 1 024 workers, 10 evaluations each"),
            ("data_loading", "Data loading, 51x51x25 format"),
            ("async_training", "Asynchronous training: allreduce vs downpour vs EASGD at np=3, one rank 5x slower"),
            ("gan_cpu", "The full angle 3DGAN on this CPU: fp32 and bf16, FLOP floor, bf16 loss tracking"),
            ("generate", "Fast simulation: showers/s of the full generator, PyTorch fp32/bf16 and ONNX Runtime"),
            ("convergence", "3DGAN time-to-quality at np = 1, 2, 4 (`python bench/convergence.py`)"),
            ("convergence_quick", "3DGAN time-to-quality, smoke run (`python bench/convergence.py --quick`: no evidence for a rule)"),
            ("resnet_synthetic", "Horovod's synthetic benchmark: torchvision ResNet-18, mpilearn vs Horovod vs DDP"),
            ("keras_throughput", "Small 3DGAN: Keras 3 (TensorFlow, torch backends) vs PyTorch"),
            ("tf_peer", "The original Accelarated3DGAN (TF2, MultiWorkerMirroredStrategy) beside mpilearn (`python bench/tf_peer.py`)"),
            ("tf_peer_quick", "The original Accelarated3DGAN beside mpilearn, smoke run (`python bench/tf_peer.py --quick`: tiny, numbers mean nothing)"),
            ("gpu/gan3d", "GPU: the 3DGAN on one H100, mpilearn vs plain PyTorch (bench/gpu_3dgan.py, run on the GPU machine)")]


def versions():
    import mpi4py
    import numpy
    import torch
    from mpi4py import MPI

    mpi = MPI.Get_library_version().splitlines()[0].strip("\x00 ")  # Open MPI ends it with a NUL
    return (f"Python {platform.python_version()}, torch {torch.__version__}, numpy {numpy.__version__}, "
            f"mpi4py {mpi4py.__version__}, {mpi}")


def main():
    cpu = subprocess.run("lscpu | grep 'Model name' | cut -d: -f2", shell=True, capture_output=True,
                         text=True).stdout.strip() or platform.processor()
    lines = ["# Benchmark results", "",
             f"Machine: {cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}; "
             f"shared and noisy: compare ratios within one table, not across runs.", "",
             f"Versions: {versions()}", "", f"Collected {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
             "by `make bench` (scripts in bench/, raw JSON in bench/results/).", ""]
    for name, title in SECTIONS:
        path = os.path.join(RES, name + ".md")
        lines += [f"## {title}", ""]
        lines += [open(path).read().rstrip(), ""] if os.path.exists(path) else ["(not run)", ""]
    open(os.path.join(RES, "collected.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
