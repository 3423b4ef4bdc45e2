"""Faster variants of an exported generator (int8 through ONNX Runtime's quantisation tools; bf16
as a ``torch.export`` program whose layers run under bf16 autocast) and the physics gate each
must pass before it is written.

The gate: the fp32 file and the variant make showers for the same conditions and the same noise
(seed B); the fp32 file makes a second set with other noise (seed A). Each metric of
``GATE_METRICS`` between fp32(B) and variant(B) is what the variant moved; the same metric between
fp32(A) and fp32(B) is the fp32 generator's own seed-to-seed spread. A variant passes when every
number it moved is at most that spread. A metric that is not finite for the fp32 spread either
(the reference metric on showers too far off for its fit) is reported and not gated.
"""
from __future__ import annotations

import json
from typing import Callable, Dict

import numpy as np

from . import physics


# the numbers of ``physics.score`` (lower is closer) that the gate compares; a new metric joins
# as one more name here
GATE_METRICS = ("score", "reference_metric", "sampling_fraction_mre", "fpd")


def conditions(meta: dict, n: int, seed: int, latent: int) -> Dict[str, np.ndarray]:
    """ONNX inputs of ``n`` showers with energies and angles drawn uniformly from the run's
    training ranges (``meta``: the export metadata; 10-500 GeV and 60-120 deg when not recorded)
    and noise from ``seed``."""
    rng = np.random.default_rng(seed)
    lo, hi = _span(meta, "energy_range_gev", (10.0, 500.0))
    feeds = {"noise": rng.standard_normal((n, latent)).astype(np.float32),
             "energy": (rng.uniform(lo, hi, n) / 100).astype(np.float32)}
    if meta.get("variant") == "angle":
        lo, hi = _span(meta, "angle_range_deg", (60.0, 120.0))
        feeds["angle"] = np.deg2rad(rng.uniform(lo, hi, n)).astype(np.float32)
    return feeds


def _span(meta, key, default):
    value = meta.get(key)
    if isinstance(value, str):
        value = json.loads(value)
    return tuple(value) if value else default


def with_noise(feeds: dict, seed: int) -> dict:
    """``feeds`` with the noise redrawn from ``seed`` (same conditions)."""
    out = dict(feeds)
    out["noise"] = np.random.default_rng(seed).standard_normal(feeds["noise"].shape).astype(np.float32)
    return out


class CalibrationReader:
    """ONNX Runtime's ``CalibrationDataReader`` protocol: batches of conditions from the
    training ranges, for static quantisation's activation ranges."""

    def __init__(self, meta: dict, latent: int, batches: int = 8, batch: int = 4, seed: int = 1234):
        self.settings = {"batches": batches, "batch": batch, "seed": seed,
                         "conditions": "uniform in the training ranges"}
        self._feeds = iter([conditions(meta, batch, seed + i, latent) for i in range(batches)])

    def get_next(self):
        return next(self._feeds, None)

    def rewind(self):  # some ORT versions call it between calibration passes
        pass


def quantize_int8(src: str, dst: str, mode: str, meta: dict, latent: int) -> dict:
    """``src`` (fp32 ONNX) as int8 in ``dst``; returns the settings to record in its metadata.
    ``dynamic``: int8 weights, activation scales computed per call (no calibration);
    ``static``: QDQ with activation scales calibrated (MinMax) on the training ranges."""
    import os

    from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                          quantize_dynamic, quantize_static)
    from onnxruntime.quantization.shape_inference import quant_pre_process

    prepared = dst + ".pre.onnx"
    quant_pre_process(src, prepared, skip_symbolic_shape=True)
    try:
        if mode == "dynamic":
            quantize_dynamic(prepared, dst, weight_type=QuantType.QInt8)
            return {"precision": "int8", "quantization": "dynamic", "weights": "int8 per tensor",
                    "activations": "uint8, scale per call"}
        reader = CalibrationReader(meta, latent)

        class Reader(CalibrationDataReader):  # ORT checks the base class
            get_next = staticmethod(reader.get_next)

        quantize_static(prepared, dst, Reader(), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
        return {"precision": "int8", "quantization": "static QDQ", "weights": "int8 per tensor",
                "activations": "uint8, MinMax calibrated", "calibration": reader.settings}
    finally:
        if os.path.exists(prepared):
            os.remove(prepared)


def session(path: str, threads: int = 0):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    return onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def runner(path) -> Callable[[dict], np.ndarray]:
    """feeds -> cells of the exported file ``path``: ONNX Runtime (CPU) for ``.onnx``, the
    ``torch.export`` program for ``.pt2`` (the bf16 variant); a ``torch.nn.Module`` (an
    in-process variant such as int8-fast) runs as it is."""
    if not isinstance(path, str):
        return module_runner(path)
    if not path.endswith(".pt2"):
        sess = session(path)
        return lambda feeds: sess.run(None, feeds)[0]
    import torch

    return module_runner(torch.export.load(path).module())


def module_runner(module) -> Callable[[dict], np.ndarray]:
    import torch

    def run(feeds):
        with torch.inference_mode():
            return module(*[torch.from_numpy(feeds[k]) for k in feeds]).numpy()
    return run


def _features(run, feeds: dict) -> dict:
    return physics.features(run(feeds), feeds["energy"] * 100.0, feeds.get("angle"))


def gate(fp32_path, variant_path, meta: dict, latent: int, events: int = 64,
         seed: int = 0) -> dict:
    """The physics gate (module doc) on ``events`` showers: per metric the variant's move and the
    fp32 spread, and ``passed``. Each side is a file or a module (see :func:`runner`)."""
    reference, variant = runner(fp32_path), runner(variant_path)
    feeds_b = conditions(meta, events, seed, latent)
    fp32_b = _features(reference, feeds_b)
    fp32_a = _features(reference, with_noise(feeds_b, seed + 1))
    moved = _features(variant, feeds_b)
    moved_by, spread = physics.score(fp32_b, moved), physics.score(fp32_b, fp32_a)
    rows = {name: {"moved": float(moved_by[name]), "fp32_spread": float(spread[name])}
            for name in GATE_METRICS}
    return {"metrics": rows, "events": events, "seed": seed,
            "passed": all(_within(r) is not False for r in rows.values())}


def _within(row: dict):
    """True/False: the variant moved a metric by at most the fp32 spread; None: not measured
    (the spread itself is not finite)."""
    if not np.isfinite(row["fp32_spread"]):
        return None
    return bool(row["moved"] <= row["fp32_spread"])


def describe(result: dict) -> str:
    def one(name, r):
        if _within(r) is None:
            return f"{name} not finite for the fp32 generator itself (not gated)"
        return (f"{name} moved {r['moved']:.4g} against the fp32 seed-to-seed spread "
                f"{r['fp32_spread']:.4g}" + ("" if _within(r) else " (TOO FAR)"))
    return "; ".join(one(n, r) for n, r in result["metrics"].items()) + \
        f" on {result['events']} showers"
