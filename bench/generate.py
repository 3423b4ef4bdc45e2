"""Fast-simulation speed: showers/s of the full angle 3DGAN generator (with its post-processing,
``mpilearn.calo.runs.ShowerModel``, as generate and export run it), per batch size, in PyTorch
fp32, PyTorch bf16 autocast and ONNX Runtime fp32 and int8 (dynamic and static QDQ, as
``export --precision int8`` makes them; ONNX Runtime rows are skipped on cuda where onnxruntime
has no CUDA execution provider).

    python bench/generate.py [--quick] [--device cpu|cuda] [--batches 1 100 10000] [--threads 2]
        [--checkpoint RUN] [--min-seconds 5] [--rows torch:bf16-fast ...] [--ceiling fp32=200,...]
        [--out bench/results/generate] [--max-isa avx2] [--append]

Also the "-fast" rows (CPU): the generator rewritten for CPU inference (mpilearn.calo.fastpath:
the same function in fp32-fast, 0.21 instead of 3.63 GFLOP in its first layer; bf16-fast; int8-fast
with oneDNN int8 convolutions) in PyTorch, and fp32-fast in ONNX Runtime. Each row gives the
GFLOP per shower of the graph it runs (torch.utils.flop_counter), its fraction of the machine's
ceiling at its precision (--ceiling) and the floor in ms that ceiling sets. --rows picks rows.

Each row: one untimed call at a small batch (kernel selection), then calls of the row's batch
until --min-seconds have passed (at least one); showers/s = showers / seconds, the noise drawn
beforehand. Without --checkpoint the weights are random (speed does not depend on them).
Targets (issue 30): >= 20 showers/s on this 2-core CPU at the best batch; >= 2 000 showers/s
on one H100 in bf16. A batch whose activations would not fit in --max-gb runs as chunks (the
row says so): 10 000 showers of 9 MB of live fp32 activations each are 90 GB.

Every row names the CPU and the kernels its library chose (the ``kernels`` column). ``--max-isa
avx2`` caps torch's (ATen's and oneDNN's) kernels at AVX2, as on an AVX2-only CPU, and
``--append`` adds the rows to the table at --out, so that both sit side by side:

    python bench/generate.py --batches 1 --min-seconds 2 --rows torch:int8-fast torch:fp32-fast \
        torch:bf16-fast onnxruntime:fp32 --out bench/results/generate_isa
    python bench/generate.py --batches 1 --min-seconds 2 --rows torch:int8-fast torch:fp32-fast \
        torch:bf16-fast --max-isa avx2 --append --out bench/results/generate_isa
"""
import argparse
import json
import os
import sys
import tempfile
import time


def _cap_isa() -> str:
    """``--max-isa ISA``: torch reads its kernel caps once, as it loads, so they are set
    before the import (ONNX Runtime has its own dispatch, not capped)."""
    if "--max-isa" not in sys.argv[:-1]:
        return ""
    isa = sys.argv[sys.argv.index("--max-isa") + 1]
    os.environ["ONEDNN_MAX_CPU_ISA"], os.environ["ATEN_CPU_CAPABILITY"] = isa.upper(), isa.lower()
    return isa


CAPPED = _cap_isa()
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = {"cpu": 20.0, "cuda": 2000.0}
CEILINGS = "fp32=200,bf16=570,int8=800"
LATENCY_MS, INT8_GAIN = 20.0, 3.0  # issue 47's CPU goals
# the largest live activations of one shower: the first conv's input and output, 54x54x48 x 8
# channels each, 4 bytes (fp32)
ACTIVATION_BYTES = 2 * 54 * 54 * 48 * 8 * 4


def _model(checkpoint):
    from mpilearn.calo.runs import ShowerModel, load_task, resolve_checkpoint, run_config, shower_model
    from mpilearn.models import gan3d

    if checkpoint:
        path = resolve_checkpoint(checkpoint, prefer_best=True)
        return shower_model(load_task(path, run_config(path))[0]), path
    return ShowerModel(gan3d.networks({"preset": "full"})[0], "angle"), "random weights"


def _rate(fn, inputs_for, batch, chunk, min_seconds):
    """showers/s of batches of ``batch``, each run as calls of at most ``chunk`` showers."""
    fn(*inputs_for(min(batch, 4)))  # untimed: kernel selection, allocations
    sizes = [min(chunk, batch - s) for s in range(0, batch, chunk)]
    inputs = {n: inputs_for(n) for n in set(sizes)}
    done, start, cpu = 0, time.perf_counter(), time.process_time()
    while True:
        for n in sizes:
            fn(*inputs[n])
        done += batch
        seconds = time.perf_counter() - start
        if seconds >= min_seconds:
            return done / seconds, seconds, time.process_time() - cpu


def variant_model(model, precision):
    """The ShowerModel a row runs: the "-fast" rows the generator rewritten for CPU inference
    (mpilearn.calo.fastpath; int8-fast calibrated on the default training ranges)."""
    from mpilearn.calo.fastpath import Chunked, fast_shower_model

    if precision == "int8-fast":  # as generate runs them: in calls of fastpath.CHUNK showers
        from mpilearn.calo.int8fast import int8_shower_model

        return Chunked(int8_shower_model(model, {"variant": model.variant}))
    if precision.endswith("-fast"):
        return Chunked(fast_shower_model(model, precision))
    return model


def flops_per_shower(model) -> float:
    """FLOPs of one shower through ``model`` (torch.utils.flop_counter: convolutions and the
    dense layer; element-wise work is not counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    from mpilearn.calo.export import example_inputs

    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        model(*example_inputs(model, 1))
    return float(counter.get_total_flops())


def _ceilings(text: str) -> dict:
    return {k: float(v) for k, v in (item.split("=") for item in text.split(","))}


def precision_kind(precision: str) -> str:
    """fp32 / bf16 / int8: the arithmetic a row's convolutions run in."""
    return next(k for k in ("int8", "bf16", "fp32") if k in precision)


def torch_runner(model, device, precision):
    model = variant_model(model, precision)

    def run(*inputs):
        with torch.inference_mode(), torch.autocast(device, dtype=torch.bfloat16,
                                                    enabled=precision == "bf16"):
            out = model(*inputs)
        if device == "cuda":
            torch.cuda.synchronize()
        return out
    return run


def instruction_set() -> str:
    """The CPU and its vector extensions that decide the int8/bf16 kernels."""
    from mpilearn.core import cpu

    return cpu.describe()


def kernels(runtime: str) -> str:
    """The kernels a row ran: torch's chosen capability (capped by --max-isa), or ONNX
    Runtime's own dispatch (the CPU's best)."""
    if runtime != "torch":
        return "the CPU's (ONNX Runtime's own dispatch)"
    got = torch.backends.cpu.get_cpu_capability()
    return f"{got} (capped: --max-isa {CAPPED})" if CAPPED else got


def onnx_cuda_missing(device) -> str:
    """Why the ONNX Runtime rows are skipped on ``device`` ('' when they run): without the CUDA
    execution provider ORT falls back to the CPU silently and takes minutes at batch 1 000."""
    import onnxruntime

    if device == "cuda" and "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return (f"skipped: onnxruntime {onnxruntime.__version__} has no CUDAExecutionProvider "
                f"(available: {', '.join(onnxruntime.get_available_providers())})")
    return ""


def onnx_runner(model, device, threads, precision="fp32"):
    import onnxruntime

    from mpilearn.calo.export import NAMES, export_onnx

    path = os.path.join(tempfile.mkdtemp(prefix="mpilearn-bench-"), "generator.onnx")
    if precision == "fp32-fast":  # as export --precision fp32-fast writes it
        from mpilearn.calo.fastpath import fast_shower_model

        export_onnx(fast_shower_model(model.cpu(), precision, onednn=False), path)
    else:
        export_onnx(model.cpu(), path)
    if precision.startswith("int8"):  # "int8 dynamic" / "int8 static": as export --precision int8
        from mpilearn.calo.precision import quantize_int8

        latent = model.generator.dense.in_features - (2 if model.variant == "angle" else 0)
        quantized = path[:-5] + ".int8.onnx"
        quantize_int8(path, quantized, precision.split()[1], {"variant": model.variant}, latent)
        path = quantized
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    providers = (["CUDAExecutionProvider"] if device == "cuda" else []) + ["CPUExecutionProvider"]
    session = onnxruntime.InferenceSession(path, options, providers=providers)
    names = NAMES[model.variant]
    return lambda *inputs: session.run(None, {k: v.cpu().numpy() for k, v in zip(names, inputs)})


def simulate_row(batch, min_seconds):
    """mpilearn.simulate's rate on the same machine: a parametric stand-in (GFlash-style
    longitudinal and radial profiles drawn with numpy), not Geant4, so the generator's ratio to
    it is not the speed-up over a full Monte Carlo."""
    import numpy as np

    from mpilearn.calo.simulate import showers

    rng = np.random.default_rng(0)

    def run(n):
        showers(rng.uniform(100, 200, n), np.deg2rad(rng.uniform(60, 120, n)), (51, 51, 25), rng)

    rate, seconds, cpu = _rate(run, lambda n: (n,), batch, batch, min_seconds)
    return {"device": "cpu", "runtime": "mpilearn.simulate (numpy, parametric, not Geant4)",
            "precision": "n/a", "batch": batch, "threads": 1, "chunk": batch,
            "showers_per_s": rate, "seconds": seconds, "cpu_bound_showers_per_s": rate * seconds / cpu}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 100, 10000])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--checkpoint")
    ap.add_argument("--min-seconds", type=float, default=5.0)
    ap.add_argument("--max-gb", type=float, default=None,
                    help="activation memory a batch may take (default: half the RAM / GPU)")
    ap.add_argument("--quick", action="store_true", help="batches 1 and 16, 1 s each (CI)")
    ap.add_argument("--rows", nargs="+", default=None,
                    help="only these rows, as runtime:precision (e.g. torch:bf16-fast "
                    "'onnxruntime:int8 static')")
    ap.add_argument("--ceiling", type=_ceilings, default=_ceilings(CEILINGS),
                   help="GFLOP/s two cores can do per precision (scaled by --threads / 2), for "
                   f"each row's fraction and floor (default {CEILINGS}: this 2-core AVX-512 "
                   "VNNI/BF16 CPU; int8 about 4x fp32 with VNNI)")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "generate"))
    ap.add_argument("--max-isa", default=None, metavar="ISA",
                    help="cap torch's kernels (e.g. avx2: an AVX2-only CPU); see the docstring")
    ap.add_argument("--append", action="store_true",
                    help="add the rows to the table at --out instead of replacing it")
    a = ap.parse_args()
    earlier = None  # --append: the table's rows and command, read before any work
    if a.append:
        if not os.path.exists(a.out + ".json"):
            ap.error(f"--append: {a.out}.json not found (run once without --append first)")
        with open(a.out + ".json") as f:
            earlier = json.load(f)
    if a.quick:
        a.batches, a.min_seconds = [1, 16], 1.0
    from mpilearn.calo.export import example_inputs

    torch.set_num_threads(a.threads)
    model, source = _model(a.checkpoint)
    if a.max_gb is None:
        total = (torch.cuda.get_device_properties(0).total_memory if a.device == "cuda"
                 else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        a.max_gb = total / 2 / 1e9

    def inputs_for(n):
        return tuple(x.to(a.device) for x in example_inputs(model, n))

    rows, skipped = [], onnx_cuda_missing(a.device)
    runtimes = [("torch", "fp32"), ("torch", "bf16"), ("onnxruntime", "fp32"),
                ("onnxruntime", "int8 dynamic"), ("onnxruntime", "int8 static")]
    if a.device == "cpu":  # the rewritten generator (CPU inference; int8-fast is CPU only)
        runtimes += [("torch", "fp32-fast"), ("torch", "bf16-fast"), ("torch", "int8-fast"),
                     ("onnxruntime", "fp32-fast")]
    runtimes = [r for r in runtimes if not a.rows or f"{r[0]}:{r[1]}" in a.rows]
    # FLOPs per shower of the graph each row runs: the "-fast" rows' rewrite does fewer
    flops = {"plain": flops_per_shower(model.cpu())}
    from mpilearn.calo.fastpath import fast_shower_model  # plain convolutions: the counter's

    flops["fast"] = flops_per_shower(fast_shower_model(model.cpu(), "fp32-fast", onednn=False))
    model.to(a.device)
    for runtime, precision in runtimes:
        if runtime == "onnxruntime" and skipped:
            rows.append({"device": a.device, "runtime": runtime, "precision": precision,
                         "threads": a.threads, "skipped": skipped})
            print(rows[-1], flush=True)
            continue
        if runtime == "torch":
            fn = torch_runner(model.to(a.device), a.device, precision)
        else:
            fn = onnx_runner(model, a.device, a.threads, precision)
            model.to(a.device)
        for batch in a.batches:
            row = {"device": a.device, "runtime": runtime, "precision": precision, "batch": batch,
                   "threads": a.threads, "cpu": instruction_set(), "kernels": kernels(runtime)}
            per_shower = ACTIVATION_BYTES / (2 if precision == "bf16" and runtime == "torch" else 1)
            row["chunk"] = min(batch, max(1, int(a.max_gb * 1e9 / per_shower)))
            row["showers_per_s"], row["seconds"], cpu = _rate(fn, inputs_for, batch, row["chunk"],
                                                              a.min_seconds)
            # what the threads would make on an idle machine: showers per CPU-second x threads
            # (an upper estimate; on a shared machine the wall-clock rate is a lower bound)
            row["cpu_bound_showers_per_s"] = row["showers_per_s"] * row["seconds"] / cpu * a.threads
            row["gflop_per_shower"] = flops["fast" if "fast" in precision else "plain"] / 1e9
            ceiling = a.ceiling.get(precision_kind(precision))
            if ceiling and a.device == "cpu":  # of the ceiling of the cores the threads use,
                ceiling *= a.threads / 2       # from the idle estimate (a loaded machine's
                rate = row["cpu_bound_showers_per_s"]  # wall rate says little)
                row["fraction_of_ceiling"] = rate * row["gflop_per_shower"] / ceiling
                row["floor_ms"] = 1000 * row["gflop_per_shower"] / ceiling
            rows.append(row)
            print(row, flush=True)
    if earlier is None:
        rows.append(simulate_row(a.batches[-1], a.min_seconds))
        print(rows[-1], flush=True)
    else:  # the earlier rows first, then these
        rows = earlier["rows"] + rows
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    data = {"rows": rows, "weights": source, "targets": TARGETS, "load_average": load,
            "gflop_per_shower": {k: v / 1e9 for k, v in flops.items()}, "ceilings_gflops": a.ceiling,
            "instruction_set": instruction_set(), "torch_threads": torch.get_num_threads(),
            "command": " ".join(["python", "bench/generate.py", *sys.argv[1:]])}
    if earlier is not None:
        data["command"] = f"{earlier['command']}`, then `{data['command']}"
    write(a.out, data, markdown(data))


def markdown(data):
    rows, targets = data["rows"], data["targets"]
    device = rows[0]["device"]
    ran = [r for r in rows if "showers_per_s" in r]
    ran = [r for r in ran if not r["runtime"].startswith("mpilearn.simulate")]  # the generator's
    pool = [r for r in ran if device == "cpu" or r["precision"] == "bf16"]  # GPU target: bf16
    best = max(pool, key=lambda r: r["showers_per_s"]) if pool else None
    md = [f"`{data['command']}`: the full angle generator with its post-processing "
          f"({data['weights']}), {rows[0]['threads']} threads, CPU instruction set "
          f"{data.get('instruction_set', 'not recorded')}; 1-minute load average "
          f"{data['load_average']:.1f} when it ended (a shared machine: other jobs ran beside "
          "it, so these are lower bounds; the last column, showers per CPU-second of this process "
          "times its threads, estimates the rate on an idle machine).", "",
          "| device | runtime | precision | kernels | batch | showers/s | ms/shower | showers per CPU-second x threads "
          "| GFLOP per shower | fraction of the ceiling (per CPU-second) | floor ms |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            md.append(f"| {r['device']} | {r['runtime']} | {r['precision']} | | | {r['skipped']} | | | | | |")
            continue
        chunks = f" (in calls of {r['chunk']})" if r["chunk"] < r["batch"] else ""
        ceiling = (f"{r['fraction_of_ceiling']:.0%} | {r['floor_ms']:.1f}" if "floor_ms" in r
                   else " | ")
        md.append(f"| {r['device']} | {r['runtime']} | {r['precision']} | {r.get('kernels', '')} | "
                  f"{r['batch']}{chunks} | "
                  f"{r['showers_per_s']:.1f} | {1000 / r['showers_per_s']:.1f} | "
                  f"{r['cpu_bound_showers_per_s']:.1f} | "
                  f"{format(r['gflop_per_shower'], '.2f') if 'gflop_per_shower' in r else ''} | "
                  f"{ceiling} |")
    if device == "cpu":
        md.append("| cuda (one H100) | torch | bf16 | | 10000 | not run (no GPU in this session) | | | | | |")
    md += ["", "mpilearn.simulate is a parametric stand-in (GFlash-style profiles drawn with numpy), "
           "not Geant4: the generator's rate beside it is not its speed-up over a full Monte Carlo.",
           ""] if any(r["runtime"].startswith("mpilearn.simulate") for r in rows) else []
    if best:
        verdict = "met" if best["showers_per_s"] >= targets[device] else "missed"
        idle = max(pool, key=lambda r: r["cpu_bound_showers_per_s"])
        guess = "met" if idle["cpu_bound_showers_per_s"] >= targets[device] else "missed"
        md += ["", f"Best: {best['showers_per_s']:.1f} showers/s ({best['runtime']} "
               f"{best['precision']}, batch {best['batch']}); target on {device} >= "
               f"{targets[device]:g} showers/s: {verdict} as measured; on an idle machine "
               f"(estimate, {idle['runtime']} {idle['precision']} batch {idle['batch']}: "
               f"{idle['cpu_bound_showers_per_s']:.1f}): {guess}. Target on one H100 in bf16 >= "
               f"{targets['cuda']:g} showers/s" + (": not measured here." if device == "cpu" else ".")]
    if device == "cpu":
        md += issue47_goals(ran)
    return md


def issue47_goals(rows) -> list:
    """Issue 47's CPU goals, each met or missed: <= 20 ms per shower at batch 1; an int8 row
    >= 3x ONNX Runtime fp32 at the largest batch measured (as measured, and per CPU-second)."""
    out = []
    one = [r for r in rows if r["batch"] == 1]
    if one:
        best = max(one, key=lambda r: r["showers_per_s"])
        ms = 1000 / best["showers_per_s"]
        out.append(f"Issue 47, <= {LATENCY_MS:g} ms per shower at batch 1: best {ms:.1f} ms "
                   f"({best['runtime']} {best['precision']}): "
                   f"{'met' if ms <= LATENCY_MS else 'missed'} as measured.")
    top = max(r["batch"] for r in rows)
    ort = [r for r in rows if r["batch"] == top and r["runtime"] == "onnxruntime"
           and r["precision"] == "fp32"]
    int8 = [r for r in rows if r["batch"] == top and "int8" in r["precision"]]
    if ort and int8:
        best = max(int8, key=lambda r: r["showers_per_s"])
        wall = best["showers_per_s"] / ort[0]["showers_per_s"]
        cpu = best["cpu_bound_showers_per_s"] / ort[0]["cpu_bound_showers_per_s"]
        out.append(f"Issue 47, int8 >= {INT8_GAIN:g}x ONNX Runtime fp32 at batch {top}: best "
                   f"{best['runtime']} {best['precision']}, {wall:.1f}x as measured, {cpu:.1f}x per "
                   f"CPU-second: {'met' if wall >= INT8_GAIN else 'missed'} as measured.")
    return [""] + out if out else []


if __name__ == "__main__":
    main()
