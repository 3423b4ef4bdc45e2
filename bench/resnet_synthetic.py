"""Horovod's own synthetic benchmark workload (examples/pytorch/pytorch_synthetic_benchmark.py):
torchvision's ResNet-18 on random 224x224 images and random labels, SGD lr 0.01, batch 32 per
rank (weak scaling), run the same way with mpilearn.torch, horovod.torch and PyTorch DDP.

    python bench/resnet_synthetic.py [--quick] [--out bench/results/resnet_synthetic]

Each (library, np) runs under mpirun; the worker side is this file with ``--worker LIB``.
torchvision is pinned to 0.28.0, the release built for torch 2.13.0, and installed by
``make bench`` into .bench-deps/ (not the project's environment). Its wheel on PyPI carries
C++ ops linked against CUDA torch, which cannot load with the CPU torch used here, so the
worker imports ``torchvision.models`` without the package's op registrations: ResNet-18 is
pure Python and needs none of them.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, ".bench-deps"))  # torchvision, pinned (make bench)


def resnet18():
    if "torchvision" not in sys.modules:  # the package without its CUDA-built ops (see above)
        spec = importlib.util.find_spec("torchvision")
        package = types.ModuleType("torchvision")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["torchvision"] = package
    from torchvision.models import resnet18 as build

    return build()


def worker(lib, batch, warmup, iters, per_iter, out):
    import torch
    import torch.nn.functional as F

    if lib == "ddp":
        import torch.distributed as dist

        rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
        size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        dist.init_process_group("gloo", rank=rank, world_size=size)
    else:
        hvd = __import__(f"{lib}.torch", fromlist=["torch"])
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    torch.manual_seed(0)
    model = resnet18()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if lib == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:  # Horovod's recipe, unchanged for mpilearn.torch
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    data = torch.randn(batch, 3, 224, 224)
    target = torch.randint(0, 1000, (batch,))

    def step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    rates = []
    for _ in range(iters):
        start = time.perf_counter()
        for _ in range(per_iter):
            step()
        rates.append(batch * per_iter / (time.perf_counter() - start))
    if rank == 0:
        import numpy as np

        json.dump({"img_s_per_rank": float(np.mean(rates)), "img_s": float(np.mean(rates)) * size,
                   "std_per_rank": float(np.std(rates))}, open(out, "w"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worker")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--json")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "resnet_synthetic"))
    a = ap.parse_args()
    warmup, iters, per_iter = (1, 2, 2) if a.quick else (2, 3, 3)
    if a.worker:
        return worker(a.worker, a.batch, warmup, iters, per_iter, a.json)
    from common import write

    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    rows = []
    # Horovod as its docs set it up (defaults), and at np=2 once more with a 20 ms cycle: its
    # background thread runs a negotiation round every HOROVOD_CYCLE_TIME (1 ms by default)
    cases = [(1, "mpilearn", {}), (1, "horovod", {}), (1, "ddp", {}), (2, "mpilearn", {}),
             (2, "horovod", {}), (2, "horovod", {"HOROVOD_CYCLE_TIME": "20"}), (2, "ddp", {})]
    for np_, lib, extra in cases:
        out = tempfile.mktemp(suffix=".json")
        cmd = ["mpirun", "-np", str(np_), "--oversubscribe", *[x for k in extra for x in ("-x", k)],
               sys.executable, __file__,
               "--worker", lib, "--batch", str(a.batch), "--json", out] + (["--quick"] if a.quick else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**env, **extra}, cwd=REPO)
        if proc.returncode:
            raise RuntimeError(f"{lib} np={np_}: {proc.stderr[-3000:]}")
        name = lib + "".join(f" ({k}={v})" for k, v in extra.items())
        rows.append({"library": name, "np": np_, **json.load(open(out))})
        print(json.dumps(rows[-1]), flush=True)
    write(a.out, rows, markdown(rows, a.batch, warmup, iters, per_iter))


def markdown(rows, batch, warmup, iters, per_iter):
    ours = {r["np"]: r["img_s"] for r in rows if r["library"] == "mpilearn"}
    md = [f"torchvision {_tv_version()} ResNet-18, batch {batch} per rank, random 224x224 images, SGD; "
          f"{warmup} warm-up steps, then {iters} x {per_iter} timed steps (Horovod's synthetic "
          "benchmark, shortened for 2 cores); threads per rank = cores / ranks.", "",
          "| library | np | img/s (total) | img/s per rank | mpilearn / this |", "|---|---|---|---|---|"]
    md += [f"| {r['library']} | {r['np']} | {r['img_s']:.2f} | {r['img_s_per_rank']:.2f} ± {r['std_per_rank']:.2f} | "
           f"{ours[r['np']] / r['img_s']:.2f} |" for r in rows]
    md += ["", "Horovod at np=2: its background thread runs a negotiation round with the other ranks every "
           "HOROVOD_CYCLE_TIME (1 ms by default), inside which Open MPI busy-polls; with one core per rank "
           "it takes the core from the compute thread. The 20 ms-cycle row measures that cost."]
    return md


def _tv_version():
    from importlib.metadata import version

    return version("torchvision").split("+")[0]  # found on sys.path, .bench-deps first


if __name__ == "__main__":
    main()
