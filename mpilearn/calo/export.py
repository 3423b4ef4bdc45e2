"""python -m mpilearn.export: a trained 3DGAN generator for use outside Python.

    python -m mpilearn.export runs/gan                   # -> runs/gan/export/
    python -m mpilearn.export --checkpoint runs/gan/checkpoints/best.pt --output gen/

Writes ``generator.onnx`` (ONNX, for ONNX Runtime, e.g. from a C++ Geant4 fast-simulation
hook) and ``generator.pt2`` (a ``torch.export`` program: ``torch.export.load(path).module()``),
both with a dynamic batch dimension, and checks the ONNX file in ONNX Runtime against PyTorch
at two batch sizes. The post-processing is inside the graph: the output is cell energies in
GeV. Inputs and output (see ``runs.ShowerModel`` and docs/guide/fastsim.md):

    noise      float32 (N, 254) standard normal (fixed model: (N, 200))
    energy     float32 (N,)     primary energy / 100 GeV
    angle      float32 (N,)     polar angle in rad (angle model only)
    cells_gev  float32 (N, 51, 51, 25) cell energies in GeV (fixed model: (N, 25, 25, 25))

What the model is valid for goes with it: the run's training ranges (``RUN/training_ranges.json``),
the units, the angle definition, the epoch, the run and the mpilearn version, as the ONNX
file's ``metadata_props`` (every value a string; nested ones as JSON) and as
``generator.json`` beside it.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import warnings

import numpy as np

from ..core.cpu import EMULATED_BF16_COST, emulated
from ..errors import UsageError, exit_status

# torch (and .runs, which imports it) is imported where used, so that --help stays quick

NAMES = {"angle": ["noise", "energy", "angle"], "fixed": ["noise", "energy"]}
# the faster variants (--precision) and the kind of file each is written as
VARIANTS = {"fast": ("fp32-fast", "bf16-fast"),
            "files": {"int8": "onnx", "bf16": "pt2", "fp32-fast": "onnx", "bf16-fast": "pt2"}}
TOLERANCE = 1e-4  # of each shower's largest cell


def example_inputs(model, n: int, seed: int = 0) -> tuple:
    """Inputs of ``n`` events in the exported layout (energies 10-500 GeV, angles 60-120 deg)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(n, latent(model), generator=g), 0.1 + 4.9 * torch.rand(n, generator=g)]
    if model.variant == "angle":
        out.append(torch.deg2rad(60 + 60 * torch.rand(n, generator=g)))
    return tuple(out)


def _dynamic(model):
    import torch

    batch = torch.export.Dim("batch")
    return {name: {0: batch} for name in NAMES[model.variant]}


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record) -> bool:
        return self.text not in record.getMessage()


@contextlib.contextmanager
def quiet_export():
    """Silences, during one export only, the exporters' messages a user cannot act on: the
    registry's "torchvision is not installed" (torchvision ops are not in the generator), torch's
    own LeafSpec deprecation, "the axis name: batch will not be used" (every input shares the
    one batch dimension on purpose) and, saving channels-last weights, "No complete tensor found
    in the group" (it matters for weights off the CPU). Anything else still shows."""
    registry = logging.getLogger("torch.onnx._internal.exporter._registration")
    drop = _DropMessage("torchvision is not installed")
    registry.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)",
                                    category=FutureWarning)
            warnings.filterwarnings("ignore", message=r".*axis name: batch will not be used",
                                    category=UserWarning)
            # saving channels-last weights (bf16-fast) warns of trouble for weights off the
            # CPU; these are on it
            warnings.filterwarnings("ignore", message=r"No complete tensor found in the group",
                                    category=UserWarning)
            yield
    finally:
        registry.removeFilter(drop)


def export_program(model, path: str) -> None:
    """``torch.export`` with a dynamic batch, saved with ``torch.export.save``."""
    import torch

    from ..core.io import atomic_write_bytes

    with quiet_export():
        program = torch.export.export(model, example_inputs(model, 3), dynamic_shapes=_dynamic(model))
        atomic_write_bytes(path, lambda f: torch.export.save(program, f))


def export_onnx(model, path: str) -> None:
    """ONNX through the dynamo exporter (needs ``onnxscript``), batch dimension dynamic."""
    import torch

    tmp = path + ".tmp.onnx"
    with quiet_export():
        program = torch.onnx.export(model, example_inputs(model, 3), dynamo=True, verbose=False,
                                    dynamic_shapes=_dynamic(model), input_names=NAMES[model.variant],
                                    output_names=["cells_gev"])
    program.save(tmp)
    os.replace(tmp, path)


def metadata(run: str, checkpoint: str, epoch: str, variant: str) -> dict:
    """What the exported model is valid for (see the module doc)."""
    from .. import __version__
    from . import ranges

    trained = ranges.read(run) or {}
    out = {"mpilearn_version": __version__, "run": os.path.abspath(run),
           "checkpoint": os.path.abspath(checkpoint), "epoch": epoch, "variant": variant,
           "inputs": ", ".join(NAMES[variant]), "output": "cells_gev",
           "units": {"noise": "standard normal", "energy": "primary energy / 100 GeV",
                     "angle": "rad", "cells_gev": "GeV per cell"},
           "energy_range_gev": trained.get("energy_gev"),
           "training_ranges": trained or "not recorded (a run trained before mpilearn recorded them)"}
    if variant == "angle":
        out.update(angle_range_deg=trained.get("angle_deg"),
                   angle_definition=ranges.ANGLE_DEFINITION)
    return out


def write_metadata(onnx_path: str, json_path: str, meta: dict) -> None:
    """``meta`` into the ONNX file's ``metadata_props`` and into ``json_path``."""
    import json

    import onnx

    from ..core.io import atomic_write_text

    model = onnx.load(onnx_path)
    props = {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}
    onnx.helper.set_model_props(model, props)
    tmp = onnx_path + ".tmp.onnx"
    onnx.save(model, tmp)
    os.replace(tmp, onnx_path)
    atomic_write_text(json_path, json.dumps(meta, indent=1))


def check_onnx(path: str, model, batches=(1, 7)) -> float:
    """Runs ``path`` in ONNX Runtime (CPU) on the inputs PyTorch gets; returns the largest
    |ONNX - PyTorch| over each shower's largest cell, over every shower of ``batches``."""
    import onnxruntime
    import torch

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    worst = 0.0
    for n in batches:
        inputs = example_inputs(model, n, seed=n)
        with torch.inference_mode():
            expected = model(*inputs).numpy()
        got = session.run(None, {k: v.numpy() for k, v in zip(NAMES[model.variant], inputs)})[0]
        if got.shape != expected.shape:
            raise RuntimeError(f"ONNX output has shape {got.shape}, PyTorch {expected.shape}")
        peak = np.maximum(expected.reshape(n, -1).max(1), 1e-30)
        worst = max(worst, float((np.abs(got - expected).reshape(n, -1).max(1) / peak).max()))
    return worst


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpilearn.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", nargs="?", help="run directory (its best, else latest, checkpoint)")
    p.add_argument("--checkpoint", help="checkpoint file (e.g. checkpoints/best.pt), 'latest' pointer or folder")
    p.add_argument("--config", help="the run's config.yaml (default: next to checkpoints/)")
    p.add_argument("--output", help="folder for generator.onnx and generator.pt2 "
                   "(default RUN/export)")
    p.add_argument("--overwrite", action="store_true", help="replace files already there")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the ONNX Runtime comparison")
    p.add_argument("--precision", choices=("fp32", "bf16", "int8", *VARIANTS["fast"]),
                   default="fp32",
                   help="int8: also write generator.int8.onnx (ONNX Runtime quantisation, for "
                   "CPUs); bf16: also write generator.bf16.pt2 (a torch.export program under "
                   "bf16 autocast, for GPUs and bf16 CPUs); fp32-fast: also write "
                   "generator.fp32-fast.onnx (the graph rewritten for CPU inference, the same "
                   "function: mpilearn.calo.fastpath); bf16-fast: also write "
                   "generator.bf16-fast.pt2 (that rewrite in bf16, channels-last, oneDNN: the "
                   "fastest on a bf16 CPU at batch 1); each written only if its physics gate "
                   "passes (see mpilearn.calo.precision)")
    p.add_argument("--int8-mode", choices=("dynamic", "static"), default="dynamic",
                   help="dynamic: int8 weights, activation scales per call (default: the faster "
                   "on a CPU at batch 1); static: QDQ calibrated on the training ranges")
    p.add_argument("--force", action="store_true",
                   help="write a variant that fails its physics gate (with a warning)")
    p.add_argument("--gate-events", type=int, default=64, help="showers per physics gate sample")
    args = p.parse_args(argv)
    from .runs import load_task, resolve_checkpoint, run_config, shower_model

    try:
        if not (args.run or args.checkpoint):
            raise UsageError("give a run directory or --checkpoint")
        checkpoint = resolve_checkpoint(args.checkpoint or args.run, prefer_best=True)
        config = run_config(checkpoint, args.config)
        run = os.path.dirname(os.path.dirname(checkpoint))
        output = args.output or os.path.join(run, "export")
        paths = {kind: os.path.join(output, f"generator.{kind}") for kind in ("onnx", "pt2", "json")}
        variant = [f"generator.{args.precision}.{ext}" for ext in
                   (VARIANTS["files"].get(args.precision), "json")] if args.precision != "fp32" else []
        there = [path for path in [*paths.values(), *(os.path.join(output, v) for v in variant)]
                 if os.path.exists(path)]
        if there and not args.overwrite:
            raise UsageError(f"{there[0]} exists (give --overwrite to replace it)")
        if os.path.isfile(output):
            raise UsageError(f"--output {output} is a file, not a folder")
        task, epoch = load_task(checkpoint, config)
        model = shower_model(task)
        os.makedirs(output, exist_ok=True)
        export_program(model, paths["pt2"])
        export_onnx(model, paths["onnx"])
        write_metadata(paths["onnx"], paths["json"], metadata(run, checkpoint, epoch, task.variant))
    except Exception as err:  # UsageError: status 2; anything else: its traceback
        return exit_status(err)
    print(f"exported {checkpoint} ({epoch}): {paths['onnx']}, {paths['pt2']}, and what it is "
          f"valid for in {paths['json']}")
    if args.check:
        worst = check_onnx(paths["onnx"], model)
        print(f"ONNX Runtime vs PyTorch at batch 1 and 7: max |difference| = {worst:.2e} of the "
              f"shower's largest cell (tolerance {TOLERANCE:g})")
        if worst > TOLERANCE:
            return 1
    if args.precision != "fp32":
        meta = metadata(run, checkpoint, epoch, task.variant)
        return write_variant(paths["onnx"], args, meta, model, output)
    return 0


def make_variant(model, fp32_path: str, output: str, args, meta: dict) -> tuple:
    """(path, settings) of the ``args.precision`` variant of ``model`` (fp32 in ``fp32_path``)."""
    from . import precision
    from .runs import ShowerModel

    if args.precision == "int8":
        path = os.path.join(output, "generator.int8.onnx")
        return path, precision.quantize_int8(fp32_path, path, args.int8_mode, meta, latent(model))
    if args.precision in VARIANTS["fast"]:
        return fast_variant(model, output, args.precision)
    path = os.path.join(output, "generator.bf16.pt2")
    export_program(ShowerModel(model.generator, model.variant, bf16=True), path)
    return path, {"precision": "bf16", "quantization": "bf16 autocast",
                  "weights": "fp32, cast to bf16 per layer", "activations": "bf16 in the "
                  "generator's layers, fp32 post-processing", "runtime": "torch.export "
                  "(torch.export.load(path).module())"}


def fast_variant(model, output: str, precision: str) -> tuple:
    """(path, settings) of ``model`` rewritten by :mod:`.fastpath`: fp32 as ONNX (for ONNX
    Runtime), bf16 as a torch.export program."""
    from .fastpath import fast_shower_model

    path = os.path.join(output, f"generator.{precision}.{VARIANTS['files'][precision]}")
    fast = fast_shower_model(model, precision, onednn=False)  # exports trace plain convolutions
    if precision == "fp32-fast":
        export_onnx(fast, path)
    else:
        export_program(fast, path)
    return path, fast_settings(precision)


REWRITE = "polyphase first layer, pads folded into the convolutions"


def fast_settings(precision: str) -> dict:
    """What a fast variant is, in its metadata and in export's line about it: fp32-fast is the
    same function rewritten (ONNX); bf16-fast that rewrite in bf16 (a torch.export program)."""
    if precision == "fp32-fast":
        return {"precision": precision, "quantization": f"none: the same function, rewritten "
                f"({REWRITE})", "weights": "fp32", "runtime": "ONNX Runtime"}
    return {"precision": precision, "quantization": f"bf16: the fp32-fast rewrite ({REWRITE}) "
            "with bf16 weights and activations, channels-last; not the same function (bf16 "
            "rounding, hence the physics gate)", "weights": "bf16",
            "activations": "bf16 channels_last_3d in the generator's layers, fp32 "
            "post-processing", "runtime": "torch.export (torch.export.load(path).module()); on "
            "a CPU its bf16 convolutions are oneDNN's"}


def latent(model) -> int:
    return model.generator.dense.in_features - (2 if model.variant == "angle" else 0)


def write_variant(fp32_path: str, args, meta: dict, model, output: str) -> int:
    """The ``args.precision`` variant of the generator in ``output``, kept only if its physics
    gate passes (or with --force): 0 written, 2 refused. Its settings and gate go into its
    metadata (``generator.<precision>.json``; for ONNX also the file's metadata_props)."""
    import json

    from ..core.io import atomic_write_text
    from . import precision

    path, settings = make_variant(model, fp32_path, output, args, meta)
    result = precision.gate(fp32_path, path, meta, latent(model), events=args.gate_events)
    numbers = precision.describe(result)
    if not result["passed"] and not args.force:
        os.remove(path)
        print(f"export: refused {path}: its physics moved by more than the fp32 generator's own "
              f"seed-to-seed spread: {numbers} (give --force to write it anyway)", file=sys.stderr)
        return 2
    if not result["passed"]:
        print(f"export: warning: writing {path} with --force although its physics gate failed: "
              f"{numbers}", file=sys.stderr)
    record = {**meta, **settings, "physics_gate": result, "fp32_file": os.path.basename(fp32_path)}
    json_path = os.path.splitext(path)[0] + ".json"
    if path.endswith(".onnx"):
        write_metadata(path, json_path, record)
    else:
        atomic_write_text(json_path, json.dumps(record, indent=1))
    print(f"{settings['precision']} ({settings['quantization']}): {path}; physics gate "
          f"{'passed' if result['passed'] else 'FAILED'}: {numbers}")
    why = emulated(args.precision)
    if why:  # the file is for GPUs and bf16 CPUs: say what it costs here
        print(f"export: note: {path} is for GPUs and CPUs with bf16 units; on this CPU, {why}: "
              f"{EMULATED_BF16_COST}; here use fp32-fast or int8-fast", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
