"""User-facing lines that say what happened: the variant export wrote, the file and runtime
generate ran, where a resumed run goes on, who took over rank 0's duties."""
import json
import os
from types import SimpleNamespace

import pytest


# --- export --precision bf16-fast names itself, its file and what it is ---


@pytest.mark.unit
def test_fast_settings_describe_each_variant_as_itself():
    from mpilearn.calo.export import fast_settings

    fp32, bf16 = fast_settings("fp32-fast"), fast_settings("bf16-fast")
    assert fp32["precision"] == "fp32-fast" and "the same function" in fp32["quantization"]
    assert fp32["weights"] == "fp32" and fp32["runtime"] == "ONNX Runtime"
    assert bf16["precision"] == "bf16-fast" and bf16["weights"] == "bf16"
    assert bf16["quantization"].startswith("bf16") and "not the same function" in bf16["quantization"]
    assert "torch.export" in bf16["runtime"] and "bf16" in bf16["activations"]


@pytest.mark.unit
def test_export_bf16_fast_line_names_bf16_fast_and_its_file(tmp_path, monkeypatch, capsys):
    """write_variant -> make_variant -> fast_variant as export runs them; the rewrite, the
    program's export and the physics gate (tested on a trained run in test_generate) are
    stand-ins here."""
    from mpilearn.calo import export, fastpath, precision

    monkeypatch.setattr(fastpath, "fast_shower_model", lambda model, p, onednn=True: model)
    monkeypatch.setattr(export, "export_program", lambda model, path: open(path, "wb").close())
    result = {"passed": True, "events": 2, "seed": 0, "metrics": {}}
    monkeypatch.setattr(precision, "gate", lambda *a, **k: result)
    model = SimpleNamespace(variant="angle", generator=SimpleNamespace(
        dense=SimpleNamespace(in_features=256)))
    args = SimpleNamespace(precision="bf16-fast", gate_events=2, force=False)
    assert export.write_variant(str(tmp_path / "generator.onnx"), args, {"variant": "angle"},
                                model, str(tmp_path)) == 0
    line = capsys.readouterr().out.strip()
    path = tmp_path / "generator.bf16-fast.pt2"
    assert line.startswith(f"bf16-fast (bf16: the fp32-fast rewrite ("), line
    assert f"): {path}; physics gate passed" in line, line
    assert "none: the same function" not in line, line
    record = json.load(open(tmp_path / "generator.bf16-fast.json"))
    assert record["precision"] == "bf16-fast" and record["weights"] == "bf16"
