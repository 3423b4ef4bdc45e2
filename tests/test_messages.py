"""User-facing lines that say what happened: the variant export wrote, the file and runtime
generate ran, where a resumed run goes on, who took over rank 0's duties."""
import json
import os
from types import SimpleNamespace

import pytest

from conftest import ENV, REPO, TESTS, mpirun, train_args


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


# --- generate --runtime onnx names the file and ONNX Runtime; --threads ---


def onnx_file(path, op="Identity", domain="", checkpoint="/no/such/ckpt.pt"):
    """A one-node ONNX file (``op`` from ``domain``) with export's 'checkpoint' metadata."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"], domain=domain)], "g", [x], [y])
    imports = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=imports)
    helper.set_model_props(model, {"checkpoint": checkpoint})
    onnx.save(model, str(path))
    return str(path)


def onnx_args(run, **kw):
    return SimpleNamespace(**{"run": run, "checkpoint": None, "runtime": "onnx", "threads": None,
                              **kw})


@pytest.mark.unit
def test_generate_onnx_errors_name_the_file_and_onnx_runtime(tmp_path, monkeypatch):
    import sys

    from mpilearn.calo.generate import onnx_model, prepare
    from mpilearn.errors import UsageError

    with pytest.raises(UsageError, match=r"^--runtime onnx: give the exported \.onnx file"):
        prepare(onnx_args(None))  # was: "give a run directory or --checkpoint"
    missing = str(tmp_path / "missing.onnx")
    with pytest.raises(UsageError, match=f"^--runtime onnx: {missing} is not a file"):
        prepare(onnx_args(missing))
    # an ONNX file that ONNX Runtime cannot load (an op it does not know)
    bad = onnx_file(tmp_path / "bad.onnx", op="NoSuchOp", domain="no.such.domain")
    with pytest.raises(UsageError) as err:
        onnx_model(bad, "fixed")
    assert str(err.value).startswith(f"--runtime onnx: ONNX Runtime could not load {bad}: ")
    # ONNX Runtime not installed: said before any model is built
    good = onnx_file(tmp_path / "good.onnx")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(UsageError) as err:
        prepare(onnx_args(good))
    assert str(err.value).startswith(f"--runtime onnx: running {good} needs ONNX Runtime"), err.value
    assert "pip install onnxruntime" in str(err.value)


@pytest.mark.unit
def test_generate_threads_reach_onnx_runtime_and_zero_is_refused(tmp_path, monkeypatch):
    from mpilearn.calo import precision
    from mpilearn.calo.generate import onnx_model, prepare
    from mpilearn.errors import UsageError

    with pytest.raises(UsageError, match=r"^--threads 0: must be at least 1$"):
        prepare(onnx_args(onnx_file(tmp_path / "g.onnx"), threads=0))
    made = []
    real = precision.session
    monkeypatch.setattr(precision, "session", lambda path, threads=0: made.append(
        real(path, threads)) or made[-1])
    onnx_model(onnx_file(tmp_path / "id.onnx"), "fixed", threads=1)
    assert made[0].get_session_options().intra_op_num_threads == 1


@pytest.fixture(scope="module")
def exported(tmp_path_factory, showers_dir):
    """A small-preset 3DGAN trained one step (the run) and its export (generator.onnx)."""
    import glob


    folder = tmp_path_factory.mktemp("gan")
    first = sorted(glob.glob(f"{showers_dir}/*.h5"))[0]
    proc = mpirun(1, train_args("--set", f"model={REPO}/models/gan3d.py",
                                "--set", f"data.files=[{first}]", "--set", "hparams.preset=small",
                                "--set", "train.batch_size=8", "--set", "train.epochs=1",
                                "--set", "train.max_steps_per_epoch=1",
                                "--set", "data.val_fraction=0.1", "--output", str(folder / "run")))
    assert proc.returncode == 0, proc.stderr
    proc = mpirun(1, ["-m", "mpilearn.export", str(folder / "run"), "--output",
                      str(folder / "x"), "--no-check"])
    assert proc.returncode == 0, proc.stderr
    return folder / "run", folder / "x" / "generator.onnx"


def test_generate_says_it_ran_the_onnx_file_in_onnx_runtime_with_its_threads(exported, tmp_path):

    run, onnx = exported
    common = ("--events", "3", "--batch-size", "2", "--energy", "150", "--no-progress")
    proc = mpirun(1, ["-m", "mpilearn.generate", str(onnx), "--runtime", "onnx", "--threads", "1",
                      "--output", str(tmp_path / "o.h5"), *common])
    assert proc.returncode == 0, proc.stderr
    checkpoint = run / "checkpoints" / "ckpt-e0001-s0000000.pt"
    assert (f"generated 3 showers from {onnx} in ONNX Runtime (--runtime onnx; exported from "
            f"{checkpoint}, epoch 1) on 1 rank(s), cpu, 1 thread(s) per rank: ") in proc.stdout, \
        proc.stdout
    # torch: --threads sets torch's threads (the tests' environment has OMP_NUM_THREADS=1)
    proc = mpirun(1, ["-m", "mpilearn.generate", str(run), "--threads", "2", "--device", "cpu",
                      "--output", str(tmp_path / "t.h5"), *common])
    assert proc.returncode == 0, proc.stderr
    # the default, --precision auto: on the CPU, fp32-fast (the same function) below 2 000
    assert " on 1 rank(s), cpu, fp32-fast (--precision auto), 2 thread(s) per rank: " \
        in proc.stdout, proc.stdout
    assert "emulated" not in proc.stderr
    # bf16 on a CPU without AVX-512 BF16 or AMX (stubbed: this one has them) warns, once
    bf16 = ["-m", "mpilearn.generate", str(run), "--precision", "bf16-fast", "--device", "cpu",
            "--output", str(tmp_path / "b.h5"), "--overwrite", *common]
    proc = mpirun(1, bf16, env={"MPILEARN_CPU_FLAGS": "avx2 avx512f"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("mpilearn: warning: --precision bf16-fast on ") == 1, proc.stderr
    assert "(avx2 avx512f) has no AVX-512 BF16 or AMX: its bf16 arithmetic is emulated: " \
        "measured on an AVX2-only AMD EPYC, bf16-fast took 2 220 ms per shower" in proc.stderr
    proc = mpirun(1, bf16, env={"MPILEARN_CPU_FLAGS": "avx2 avx512f avx512_bf16"})
    assert proc.returncode == 0 and "emulated" not in proc.stderr, proc.stderr
    proc = mpirun(1, ["-m", "mpilearn.generate", str(run), "--threads", "0",
                      "--output", str(tmp_path / "z.h5"), *common])
    assert proc.returncode == 2 and "mpilearn: error: --threads 0: must be at least 1" \
        in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


# --- where a resumed run goes on ---


@pytest.mark.unit
def test_resume_line_says_where_training_goes_on():
    from mpilearn.train.engine import resume_line

    assert resume_line("c.pt", 1, 0, 3) == \
        "mpilearn: resumed from c.pt, saved at the end of epoch 1: going on with epoch 2"
    assert resume_line("c.pt", 1, 5, 3) == \
        "mpilearn: resumed from c.pt, saved in epoch 2 after step 5 of it: going on with its step 6"
    assert resume_line("c.pt", 0, 0, 3) == \
        "mpilearn: resumed from c.pt, saved before the first step: going on with epoch 1"
    assert resume_line("c.pt", 3, 0, 3) == \
        "mpilearn: resumed from c.pt, saved at the end of epoch 3: all 3 epoch(s) of " \
        "train.epochs are done"


def test_resumed_runs_say_the_epoch_and_step_they_go_on_with(toy_file, tmp_path):
    """Stopped after step 6 of 4-step epochs (epoch 2, after its step 2), resumed; then resumed
    again, after the end of epoch 2, for a third epoch."""

    out = tmp_path / "run"

    def train(epochs, *extra, env=None):
        return mpirun(1, train_args("--set", f"model={TESTS}/models/elastic_mlp.py",
                                    "--set", f"data.files=[{toy_file}]",
                                    "--set", "train.batch_size=8",
                                    "--set", "train.max_steps_per_epoch=4",
                                    "--set", f"train.epochs={epochs}", "--output", str(out),
                                    *extra), env=env)

    stop = train(2, env={"MPILEARN_TEST_STOP": "6"})
    assert stop.returncode == 75, stop.stderr
    proc = train(2, "--resume")
    assert proc.returncode == 0, proc.stderr
    ckpt = out / "checkpoints" / "ckpt-e0001-s0000002.pt"
    assert (f"mpilearn: resumed from {ckpt}, saved in epoch 2 after step 2 of it: going on "
            "with its step 3\n") in proc.stdout, proc.stdout
    proc = train(3, "--resume")  # train.epochs 2 -> 3
    assert proc.returncode == 0, proc.stderr
    ckpt = out / "checkpoints" / "ckpt-e0002-s0000000.pt"
    assert (f"mpilearn: resumed from {ckpt}, saved at the end of epoch 2: going on with "
            "epoch 3\n") in proc.stdout, proc.stdout


# --- who took over rank 0's duties ---


def test_a_lost_rank_0_names_the_rank_that_took_its_duties_over(toy_file, tmp_path):
    """np=2 under ULFM, world rank 0 killed after 6 steps: world rank 1 goes on alone as rank 0
    and says so (test_elastic: the same at np=3)."""
    import subprocess
    import sys


    out = tmp_path / "run"
    proc = subprocess.run(
        ["mpirun", "--with-ft", "ulfm", "-np", "2", "--oversubscribe", "-x", "MPILEARN_TEST_KILL",
         sys.executable, *train_args("--set", f"model={TESTS}/models/elastic_mlp.py",
                                     "--set", f"data.files=[{toy_file}]",
                                     "--set", "data.val_fraction=0.0625", "--set", "train.epochs=1",
                                     "--set", "train.batch_size=4",
                                     "--set", "train.max_steps_per_epoch=10",
                                     "--set", "train.elastic.min_ranks=1", "--output", str(out))],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**ENV, "MPILEARN_TEST_KILL": "0:6"})
    assert proc.returncode == 0, proc.stderr
    assert ("mpilearn: lost rank 0 on " in proc.stdout and "; going on with 1 rank(s) from step 6"
            in proc.stdout), proc.stdout
    assert proc.stdout.count("; rank 0 was lost: its duties (checkpoints, logs) moved to rank 0 "
                             "(formerly rank 1)\n") == 1, proc.stdout


@pytest.mark.unit
def test_the_cpu_says_which_precision_it_emulates_and_auto_picks_by_device_and_size():
    from types import SimpleNamespace

    from mpilearn.calo.generate import AUTO_INT8_EVENTS, auto_precision
    from mpilearn.core import cpu

    assert cpu.flags({cpu.FLAGS_ENV: "fpu avx2 sse4_2 avx512_bf16"}) == {"avx2", "avx512_bf16"}
    assert cpu.emulated("bf16-fast", {"avx2"}).endswith(
        "(avx2) has no AVX-512 BF16 or AMX: its bf16 arithmetic is emulated")
    assert cpu.emulated("bf16", {"avx2", "amx_bf16"}) is None
    assert cpu.emulated("fp32-fast", {"avx2"}) is None and cpu.emulated("int8-fast", set()) is None
    torch_task = SimpleNamespace()  # not Keras
    assert auto_precision(torch_task, "cpu", 10) == "fp32-fast"
    assert auto_precision(torch_task, "cpu", AUTO_INT8_EVENTS) == "int8-fast"
    assert auto_precision(torch_task, "cuda:0", 10 ** 6) == "fp32"
    assert auto_precision(torch_task, "cpu", 10 ** 6, runtime="onnx") == "fp32"
