"""3DGAN training throughput on one GPU: mpilearn's GAN task (DistributedOptimizer over NCCL,
finite-gradient guard, per-event RNG streams, global-batch loss scaling) next to plain PyTorch
running the same four updates with no mpilearn at all (the ceiling for wrapper overhead).

    python bench/gpu_3dgan.py [--steps 20] [--quick] [--compile MODE] [--channels-last]
                              [--batches 64,128] [--device cpu] [--out bench/results/gpu/gan3d]

For each preset (full angle model, small) x precision (fp32, bf16 autocast) x batch (64, 128):
events/s of both sides, mpilearn's time split (RNG draws on the host, allreduce, the rest),
peak memory allocated, FLOPs per step (torch.utils.flop_counter, forward and backward; the
profiler's own with_flops count alongside) and MFU against the dense bf16 peak. Then the
largest batch that fits, per precision. Both sides get the same pre-processed host batches
(the loader's output) and copy them to the GPU inside the step; cuDNN autotuning is on for
both (as the engine sets it). ``--compile MODE`` (torch.compile: train.compile on mpilearn's
side, ``module.compile(mode=MODE)`` on plain PyTorch's) and ``--channels-last``
(train.channels_last=true; ``.to(memory_format=torch.channels_last_3d)``) set both sides up
the same way. ``--device cpu`` runs the same code without a GPU (a check of the script).
"""
import argparse
import json
import os
import platform
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write  # noqa: E402

PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12}  # dense, SXM; per NVIDIA's datasheet


def host_batch(n, seed):
    """A pre-processed batch as the loader yields it (random cells, energies, angles)."""
    from mpilearn.calo.format import Preprocess

    rng = np.random.default_rng(seed)
    raw = {"ECAL": rng.random((n, 51, 51, 25), dtype=np.float32) * 1.2,
           "energy": rng.uniform(100, 200, n), "mtheta": rng.uniform(1.0, 2.1, n),
           "_index": np.arange(seed * n, (seed + 1) * n)}
    return Preprocess("angle")(raw)


DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def peak_gib():
    return torch.cuda.max_memory_allocated() / 2 ** 30 if DEVICE == "cuda" else 0.0


def reset_peak():
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def make_task(preset, precision, comm, compile_mode="off", channels_last=False):
    from mpilearn.models import gan3d

    torch.manual_seed(0)
    task = gan3d.build({"preset": preset})
    task.compile_mode, task.channels_last = compile_mode, "true" if channels_last else "false"
    cuda = DEVICE == "cuda"
    task.setup(comm, "cuda:0" if cuda else "cpu", "torch" if cuda else "mpi", 25 << 20)
    task.precision = precision
    return task


class Timed:
    """Wraps a method, summing its wall time (the host RNG draws)."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *a, **k):
        t = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.seconds += time.perf_counter() - t


def run_mpilearn(task, batches, steps, warmup=5):
    draws = Timed(task._draws)
    task._draws = draws
    for i in range(warmup):
        task.train_step(batches[i % len(batches)])
    sync()
    reset_peak()
    task.allreduce_seconds()  # reading it empties the optimizers' counters
    draws.seconds = 0.0
    t = time.perf_counter()
    for i in range(steps):
        task.train_step(batches[i % len(batches)])
    sync()
    wall = time.perf_counter() - t
    task._draws = draws.fn
    return {"seconds_per_step": wall / steps, "draws_s": draws.seconds / steps,
            "allreduce_s": task.allreduce_seconds() / steps, "peak_mem_gib": peak_gib()}


class Plain:
    """The same models, optimizers, losses and four updates, written as a PyTorch user would."""

    def __init__(self, preset, precision, compile_mode="off", channels_last=False):
        from mpilearn.models import gan3d

        torch.manual_seed(0)
        self.G, self.D = (m.to(DEVICE) for m in gan3d.networks({"preset": preset}))
        for m in (self.G, self.D):
            if channels_last:
                m.to(memory_format=torch.channels_last_3d)
            if compile_mode != "off":
                m.compile(mode=compile_mode)
        self.g_opt = torch.optim.RMSprop(self.G.parameters(), lr=1e-3, alpha=0.9, eps=1e-7)
        self.d_opt = torch.optim.RMSprop(self.D.parameters(), lr=1e-3, alpha=0.9, eps=1e-7)
        self.w = torch.tensor([3.0, 0.1, 25.0, 0.1], device=DEVICE)
        self.bf16 = precision == "bf16"

    def terms(self, out, label, energy, angle, ecal):
        p, aux, ang, tot = (o.float() for o in out)
        p = p.clamp(1e-7, 1 - 1e-7)
        bce = -(label * torch.log(p) + (1 - label) * torch.log(1 - p))
        mape = lambda y, q: 100 * (y - q).abs() / y.abs().clamp_min(1e-7)  # noqa: E731
        return torch.stack([bce, mape(energy, aux), (angle - ang).abs(), mape(ecal, tot)], 1)

    def update(self, opt, out, label, targets):
        loss = (self.terms(out, label, *targets) * self.w).sum(1).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    def step(self, b):
        G, D = self.G, self.D
        real = torch.from_numpy(b["images"]).to(DEVICE).unsqueeze(1)
        e, a, s = (torch.from_numpy(b[k]).to(DEVICE) for k in ("energy", "angle", "ecal"))
        n = len(e)
        flip = torch.rand(n, 2, device=DEVICE) < 0.05
        noise = torch.randn(3, n, 254, device=DEVICE)
        ones, zeros = torch.ones(n, device=DEVICE), torch.zeros(n, device=DEVICE)
        z = lambda j: torch.cat([e[:, None], a[:, None], noise[j]], 1)  # noqa: E731
        amp = lambda: torch.autocast(DEVICE, torch.bfloat16, enabled=self.bf16)  # noqa: E731
        self.d_opt.zero_grad()
        with amp():
            out = D(real)
        self.update(self.d_opt, out, torch.where(flip[:, 0], zeros, ones), (e, a, s))
        with torch.no_grad(), amp():
            G.eval()
            fake = G(z(0))
            G.train()
        self.d_opt.zero_grad()
        with amp():
            out = D(fake)
        self.update(self.d_opt, out, torch.where(flip[:, 1], ones, zeros), (e, a, s))
        D.requires_grad_(False)
        for j in (1, 2):
            self.g_opt.zero_grad()
            with amp():
                out = D(G(z(j)))
            self.update(self.g_opt, out, ones, (e, a, s))
        D.requires_grad_(True)


def run_plain(plain, batches, steps, warmup=5):
    for i in range(warmup):
        plain.step(batches[i % len(batches)])
    sync()
    reset_peak()
    t = time.perf_counter()
    for i in range(steps):
        plain.step(batches[i % len(batches)])
    sync()
    return {"seconds_per_step": (time.perf_counter() - t) / steps, "peak_mem_gib": peak_gib()}


def count_flops(plain, batch):
    """FLOPs of one step: FlopCounterMode (forward and backward convolutions and matmuls),
    and the profiler's with_flops sum (its formulas cover fewer ops)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        plain.step(batch)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                with_flops=True) as prof:
        plain.step(batch)
    profiled = sum(getattr(e, "flops", 0) or 0 for e in prof.key_averages())
    return counter.get_total_flops(), profiled


def largest_batch(preset, precision, comm, peaks, probe=True, compile_mode="off", channels_last=False):
    """The largest local batch that fits, found in two probes (a bisection at 10-60 s a step
    would not fit a GPU session): peak memory is linear in the batch, so the two measured
    batches give a line; one training step at the predicted largest batch must fit and one
    at 15 % more must run out of memory."""
    (b0, m0), (b1, m1) = sorted(peaks.items())[:2]
    per_event = (m1 - m0) / (b1 - b0)
    total = torch.cuda.mem_get_info()[1] / 2 ** 30
    guess = int((0.94 * total - (m0 - per_event * b0)) / per_event)

    def fits(n):
        task = None
        try:
            task = make_task(preset, precision, comm, compile_mode, channels_last)
            task.train_step(host_batch(n, 99))
            torch.cuda.synchronize()
            return True, torch.cuda.max_memory_allocated() / 2 ** 30
        except torch.OutOfMemoryError:
            return False, None
        finally:
            del task
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    over = int(guess * 1.15)
    ok, used = fits(guess) if probe else (None, None)
    oom = (not fits(over)[0]) if probe else None
    return {"mib_per_event": 1024 * per_event, "predicted": guess, "fits": ok,
            "peak_gib_at_predicted": None if used is None else round(used, 2), "probe_over": over, "over_runs_out": oom,
            "gpu_total_gib": total}


def versions():
    if DEVICE != "cuda":
        import platform as pf
        return {"device": f"CPU ({pf.processor() or pf.machine()})", "torch": torch.__version__,
                "cuda": None, "cudnn": None, "nccl": None, "driver": None, "mpi": "-",
                "mpi_cuda_aware": None, "python": platform.python_version()}
    info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "python": platform.python_version()}
    try:
        import subprocess

        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True).stdout.strip()
    except OSError:
        info["driver"] = "unknown"
    from mpi4py import MPI

    from mpilearn.allreduce.mpi import cuda_aware
    info["mpi"] = MPI.Get_library_version().splitlines()[0].strip("\x00 ")
    info["mpi_cuda_aware"] = cuda_aware()
    return info


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="one configuration, few steps")
    p.add_argument("--no-memory-search", action="store_true")
    p.add_argument("--configs", default="", help="e.g. full:bf16:128,small:fp32:64")
    p.add_argument("--profile", action="store_true", help="top CUDA kernels of one step")
    p.add_argument("--channels-last", action="store_true",
                   help="both sides' models in torch.channels_last_3d (train.channels_last=true)")
    p.add_argument("--compile", default="off",
                   help="torch.compile mode for both sides (train.compile): off, default, "
                        "reduce-overhead, max-autotune, max-autotune-no-cudagraphs")
    p.add_argument("--batches", default="64,128", help="local batches of the default configs")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "results", "gpu", "gan3d"))
    a = p.parse_args()
    global DEVICE
    DEVICE = a.device
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    torch.backends.cudnn.benchmark = True
    meta = versions()
    peak = next((v for k, v in PEAK_BF16.items() if k in meta["device"]), PEAK_BF16["H100"])
    configs = [(pr, prec, b) for pr in ("full", "small") for prec in ("fp32", "bf16")
               for b in map(int, a.batches.split(","))]
    if a.quick:
        configs, a.steps = [("full", "bf16", 64)], 5
    if a.configs:
        configs = [(c.split(":")[0], c.split(":")[1], int(c.split(":")[2])) for c in a.configs.split(",")]
    rows, flop_counts = [], {}
    for preset, precision, batch in configs:
        batches = [host_batch(batch, s) for s in range(4)]
        task = make_task(preset, precision, comm, a.compile, a.channels_last)
        plain = Plain(preset, precision, a.compile, a.channels_last)
        m = run_mpilearn(task, batches, a.steps, a.warmup)
        del task
        q = run_plain(plain, batches, a.steps, a.warmup)
        if (preset, batch) not in flop_counts:  # the same FLOPs in either precision
            flop_counts[preset, batch] = count_flops(plain, batches[0])
        flops, profiled = flop_counts[preset, batch]
        if a.profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                plain.step(batches[0])
                sync()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
        del plain
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        row = {"preset": preset, "precision": precision, "batch": batch, "compile": a.compile,
               "channels_last": a.channels_last,
               "mpilearn_events_s": batch / m["seconds_per_step"],
               "plain_events_s": batch / q["seconds_per_step"],
               "overhead_pct": 100 * (m["seconds_per_step"] / q["seconds_per_step"] - 1),
               "ms_step": 1e3 * m["seconds_per_step"], "ms_draws": 1e3 * m["draws_s"],
               "ms_allreduce": 1e3 * m["allreduce_s"],
               "ms_rest": 1e3 * (m["seconds_per_step"] - m["draws_s"] - m["allreduce_s"]),
               "plain_ms_step": 1e3 * q["seconds_per_step"],
               "peak_mem_gib": m["peak_mem_gib"], "plain_peak_mem_gib": q["peak_mem_gib"],
               "gflop_step": flops / 1e9, "profiler_gflop_step": profiled / 1e9,
               "mfu_pct": 100 * flops / m["seconds_per_step"] / peak}
        rows.append(row)
        print(json.dumps(row), flush=True)
    memory = {}
    if not a.no_memory_search and not a.quick and DEVICE == "cuda":
        for precision in ("fp32", "bf16"):
            peaks = {r["batch"]: r["peak_mem_gib"] for r in rows
                     if r["preset"] == "full" and r["precision"] == precision}
            if len(peaks) >= 2:
                # fp32 steps of ~2000 events take minutes: predicted only, not probed
                memory[precision] = largest_batch("full", precision, comm, peaks,
                                                  precision == "bf16", a.compile, a.channels_last)
                print(precision, memory[precision], flush=True)
    lines = [f"Device: {meta['device']}; driver {meta['driver']}; CUDA {meta['cuda']}; "
             f"cuDNN {meta['cudnn']}; NCCL {meta['nccl']}; torch {meta['torch']}; "
             f"{meta['mpi']} (CUDA-aware: {meta['mpi_cuda_aware']}); both sides: compile "
             f"{a.compile}, {'channels_last_3d' if a.channels_last else 'contiguous (NCDHW)'}", "",
             "| preset | precision | batch | mpilearn ev/s | plain PyTorch ev/s | overhead | "
             "ms/step | draws | allreduce | rest | peak GiB | GFLOP/step | MFU (bf16 peak) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['precision']} | {r['batch']} | {r['mpilearn_events_s']:.0f} | "
                     f"{r['plain_events_s']:.0f} | {r['overhead_pct']:+.1f} % | {r['ms_step']:.1f} | "
                     f"{r['ms_draws']:.1f} | {r['ms_allreduce']:.1f} | {r['ms_rest']:.1f} | "
                     f"{r['peak_mem_gib']:.2f} | {r['gflop_step']:.0f} | {r['mfu_pct']:.2f} % |")
    for precision, r in memory.items():
        probed = ("not probed" if r["fits"] is None else
                  f"one step at {r['predicted']} {'fits' if r['fits'] else 'does NOT fit'} "
                  f"(peak {r['peak_gib_at_predicted']} GiB), at {r['probe_over']} "
                  f"{'runs out of memory' if r['over_runs_out'] else 'still fits'}")
        lines.append(f"\nLargest local batch, full angle model, {precision}: {r['predicted']} "
                     f"predicted ({r['mib_per_event']:.1f} MiB per event); {probed}")
    write(a.out, {"meta": meta, "rows": rows, "largest_batch": memory,
                  "peak_bf16_flops": peak, "steps": a.steps}, lines)


if __name__ == "__main__":
    main()
