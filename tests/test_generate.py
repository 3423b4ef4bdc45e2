"""Fast simulation from a trained 3DGAN: python -m mpilearn.generate (distributed, seeded, the
calorimeter format) and python -m mpilearn.export (ONNX checked in ONNX Runtime, torch.export)."""
import glob
import json
import os

import h5py
import numpy as np
import pytest
import torch

from conftest import REPO, mpirun, shared, train_args

GAN = os.path.join(REPO, "models", "gan3d.py")


@pytest.fixture(scope="session")
def tiny_run(showers_dir, tmp_path_factory):
    """A small-preset 3DGAN trained for one step on the first showers file: a run directory
    with its latest and best checkpoints, scored on the second (test.json); trained once per
    session, shared read-only."""
    first, second = sorted(glob.glob(f"{showers_dir}/*.h5"))

    def train(folder):
        proc = mpirun(1, train_args("--set", f"model={GAN}", "--set", f"data.files=[{first}]",
                                    "--set", f"data.test_files=[{second}]",
                                    "--set", "hparams.preset=small", "--set", "train.batch_size=8",
                                    "--set", "train.epochs=1", "--set", "train.max_steps_per_epoch=1",
                                    "--set", "data.val_fraction=0.1",
                                    # keep a best checkpoint (without physics validation the GAN
                                    # has no default monitor), as a user selecting epochs would
                                    "--set", "train.best.monitor=val_g_loss",
                                    "--output", str(folder / "run")))
        assert proc.returncode == 0, proc.stderr

    return shared(tmp_path_factory, "tiny-gan-run", train) / "run"


def generate(np_, run, output, *extra):
    return mpirun(np_, ["-m", "mpilearn.generate", str(run), "--output", str(output),
                        "--no-progress", *extra])


def test_one_and_two_ranks_give_the_same_showers_that_validate_reads(tiny_run, showers_dir,
                                                                      tmp_path):
    mc = sorted(glob.glob(f"{showers_dir}/*.h5"))[0]
    args = ("--conditions", mc, "--events", "24", "--batch-size", "5", "--seed", "3")
    one, two = generate(1, tiny_run, tmp_path / "one.h5", *args), \
        generate(2, tiny_run, tmp_path / "two.h5", *args)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    assert "showers/s" in one.stdout and "on 2 rank(s)" in two.stdout
    assert "are empty" not in one.stderr + two.stderr  # the empty-shower warning's cases only
    # the run directory means the best epoch that training kept
    assert (tiny_run / "checkpoints" / "best.pt").is_file()
    assert f"from {tiny_run / 'checkpoints' / 'best.pt'} " in one.stdout, one.stdout
    with h5py.File(tmp_path / "one.h5") as a, h5py.File(tmp_path / "two.h5") as b, \
            h5py.File(mc) as m:
        assert set(a) == set(b) == {"ECAL", "energy", "mtheta"}
        for key in a:  # bit for bit (the tests run one thread per rank)
            np.testing.assert_array_equal(a[key][:], b[key][:])
        assert a["ECAL"].shape == (24, 51, 51, 25) and a["ECAL"][:].max() > 0
        np.testing.assert_allclose(a["energy"][:], m["energy"][:24])  # the file's conditions
        np.testing.assert_allclose(a["mtheta"][:], m["mtheta"][:24])
        first = a["ECAL"][:]
    # another seed: other noise; drawn conditions follow the seed as well
    other = generate(1, tiny_run, tmp_path / "other.h5", *args[:-1], "4")
    assert other.returncode == 0, other.stderr
    with h5py.File(tmp_path / "other.h5") as c:
        assert not np.array_equal(c["ECAL"][:], first)
    proc = mpirun(2, ["-m", "mpilearn.validate", "--generated", str(tmp_path / "one.h5"),
                      "--mc", mc, "--events", "24", "--no-plots", "--voxel-events", "0", "--json",
                      str(tmp_path / "v.json"), "--output", str(tmp_path / "val")])
    assert proc.returncode == 0, proc.stderr
    result = json.load(open(tmp_path / "v.json"))
    assert result["events"] > 0 and np.isfinite(result["score"])


def test_test_json_has_the_physics_numbers_on_the_test_files(tiny_run, showers_dir):
    test = json.load(open(tiny_run / "test.json"))
    assert test["files"] == [sorted(glob.glob(f"{showers_dir}/*.h5"))[1]]
    # 80 test events: 40 compared with the generator, 40 more for the MC-vs-MC floor
    assert test["test_events"] == 80  # the validation pass: every event
    assert test["test_physics_events"] == 40 and test["test_floor_events"] == 40
    assert test["test_score"] > 0 and test["test_score_floor"] > 0
    assert test["test_score_ratio"] == pytest.approx(test["test_score"] / test["test_score_floor"])
    assert np.isfinite(test["test_reference_metric_filled"])
    assert np.isfinite(test["test_sampling_fraction_mre"]) and "test_d_loss" in test
    # the CaloChallenge's numbers beside their floors, the classifier's too
    assert test["test_fpd_floor"] is not None and test["test_kpd_sigma"] is not None
    assert 0 <= test["test_auc_high"] <= 1 and test["test_auc_high_floor"] is not None
    assert (tiny_run / "validation" / "test" / "profiles.png").exists()


@pytest.mark.smoke  # make check: the np=2 run of generate
def test_drawn_conditions_lists_and_ranges(tiny_run, tmp_path):
    proc = generate(2, tiny_run, tmp_path / "log.h5", "--events", "9", "--batch-size", "4",
                    "--energy", "10", "500", "--energy-dist", "log", "--angle", "70", "110",
                    "--precision", "bf16", "--extrapolate")
    assert proc.returncode == 0, proc.stderr
    # outside the run's 100-200 GeV: generated, with one warning naming the range
    assert proc.stderr.count("warning: --extrapolate: energy 10 GeV is outside the run's "
                             "training range") == 1, proc.stderr
    with h5py.File(tmp_path / "log.h5") as f:
        e, theta = f["energy"][:], np.degrees(f["mtheta"][:])
        assert np.isfinite(f["ECAL"][:]).all()
    assert ((10 <= e) & (e <= 500)).all() and ((70 <= theta) & (theta <= 110)).all()
    proc = generate(1, tiny_run, tmp_path / "list.h5", "--events", "5", "--energy", "110", "150",
                    "--energy-dist", "list", "--angle", "90")
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr
    with h5py.File(tmp_path / "list.h5") as f:
        assert f["energy"][:].tolist() == [110, 150, 110, 150, 110]
        np.testing.assert_allclose(f["mtheta"][:], np.pi / 2, rtol=1e-6)


def test_empty_showers_are_counted_in_one_warning(tiny_run, tmp_path):
    """A generator whose every shower is empty (here: its last bias far below zero) still
    writes them, and rank 0 says once how many are empty and why that happens early on."""
    import shutil

    from mpilearn.train import checkpoint as ckpt

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    for path in glob.glob(f"{run}/checkpoints/*.pt"):
        state = ckpt.load(path)
        state["task"]["models"]["generator"]["last.bias"].fill_(-1e3)
        torch.save(state, path)
    proc = generate(2, run, tmp_path / "dead.h5", "--events", "6", "--batch-size", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("warning: 6 of 6 showers (100%) are empty (cell sum <= 0.2 GeV)") == 1, \
        proc.stderr
    assert "batch norm's running statistics" in proc.stderr
    with h5py.File(tmp_path / "dead.h5") as f:
        assert f["ECAL"].shape[0] == 6 and f["ECAL"][:].max() == 0


@pytest.mark.parametrize("extra,message", [
    (["--events", "4", "--energy", "200", "100"], "--energy-dist uniform needs two values LOW HIGH"),
    (["--events", "4", "--angle", "190"], "--angle 190 is out of range"),
    (["--events", "0"], "--events 0: must be at least 1"),
    (["--events", "2", "--precision", "int8-fast", "--gate-events", "1"],
     "--gate-events 1: must be at least 2"),
    (["--conditions", "missing.h5"], "--conditions missing.h5: no such file"),
    # the run trained on 100-200 GeV, 60-120 degrees (RUN/training_ranges.json)
    (["--events", "4", "--energy", "5000"], "energy 5000 GeV is outside the run's training range"),
    (["--events", "4", "--angle", "1.57"], "1.57 looks like radians: the angle is in degrees"),
])
def test_bad_input_is_exit_2_from_rank_0(tiny_run, tmp_path, extra, message):
    proc = generate(2, tiny_run, tmp_path / "out.h5", *extra)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count(message) == 1, proc.stderr
    assert not (tmp_path / "out.h5").exists()


def test_existing_output_is_kept(tiny_run, tmp_path):
    (tmp_path / "out.h5").write_text("earlier results")
    proc = generate(1, tiny_run, tmp_path / "out.h5", "--events", "2")
    assert proc.returncode == 2 and "exists (give --overwrite" in proc.stderr
    assert (tmp_path / "out.h5").read_text() == "earlier results"


def test_export_onnx_matches_pytorch_at_two_batch_sizes(tiny_run, tmp_path):
    proc = mpirun(1, ["-m", "mpilearn.export", str(tiny_run), "--output", str(tmp_path / "x")])
    assert proc.returncode == 0, proc.stderr
    assert "max |difference|" in proc.stdout
    # a clean export: none of the exporters' messages a user cannot act on (issue 47)
    assert "torchvision" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
    # what the model is valid for, in the ONNX file and beside it
    import onnx

    props = {p.key: p.value for p in onnx.load(str(tmp_path / "x" / "generator.onnx")).metadata_props}
    beside = json.load(open(tmp_path / "x" / "generator.json"))
    lo, hi = json.loads(props["energy_range_gev"])
    assert 100 <= lo < hi <= 200 and beside["energy_range_gev"] == [lo, hi]
    lo, hi = json.loads(props["angle_range_deg"])
    assert 60 <= lo < hi <= 120
    assert "degrees" in props["angle_definition"] and props["units"] == json.dumps(beside["units"])
    assert props["epoch"].startswith("epoch ") and props["run"] == str(tiny_run)
    assert props["mpilearn_version"] == __import__("mpilearn").__version__
    from mpilearn.calo.export import TOLERANCE, check_onnx, example_inputs
    from mpilearn.calo.runs import load_task, resolve_checkpoint, run_config, shower_model

    checkpoint = resolve_checkpoint(str(tiny_run))
    model = shower_model(load_task(checkpoint, run_config(checkpoint))[0])
    assert check_onnx(str(tmp_path / "x" / "generator.onnx"), model, (2, 9)) <= TOLERANCE
    program = torch.export.load(str(tmp_path / "x" / "generator.pt2")).module()
    for n in (1, 6):  # the torch.export program keeps the batch dynamic too
        inputs = example_inputs(model, n)
        with torch.inference_mode():
            torch.testing.assert_close(program(*inputs), model(*inputs))


def test_int8_export_passes_its_physics_gate_or_is_refused_and_a_broken_scale_is_refused(
        tiny_run, tmp_path):
    proc = mpirun(1, ["-m", "mpilearn.export", str(tiny_run), "--output", str(tmp_path / "x"),
                      "--no-check", "--precision", "int8", "--gate-events", "32"])
    int8 = tmp_path / "x" / "generator.int8.onnx"
    assert proc.returncode in (0, 2), proc.stderr
    # either way the numbers are named: each metric's move and the fp32 seed-to-seed spread
    text = proc.stdout + proc.stderr
    assert "sampling_fraction_mre moved" in text and "seed-to-seed spread" in text, text
    import onnx

    from mpilearn.calo import precision

    if proc.returncode == 0:
        props = {p.key: p.value for p in onnx.load(str(int8)).metadata_props}
        assert props["quantization"] == "dynamic" and json.loads(props["physics_gate"])["passed"]
    else:
        assert not int8.exists() and "refused" in proc.stderr
    # a deliberately broken quantisation: one layer's weight scale 30x too large
    fp32 = str(tmp_path / "x" / "generator.onnx")
    meta = {p.key: p.value for p in onnx.load(fp32).metadata_props}
    latent = 254 if meta["variant"] == "angle" else 200
    broken = str(tmp_path / "broken.onnx")
    precision.quantize_int8(fp32, broken, "dynamic", meta, latent)
    graph = onnx.load(broken)
    scale = next(t for t in graph.graph.initializer  # a convolution's (not the dense layer's)
                 if t.name.endswith("weight_scale") and ".dense." not in t.name)
    values = onnx.numpy_helper.to_array(scale) * 30
    scale.CopyFrom(onnx.numpy_helper.from_array(values.astype(np.float32), scale.name))
    onnx.save(graph, broken)
    result = precision.gate(fp32, broken, meta, latent, events=32)
    assert not result["passed"], precision.describe(result)


def test_bf16_export_is_a_gated_program_equal_to_bf16_generation_and_never_overwritten(
        tiny_run, tmp_path):
    out = tmp_path / "x"
    argv = ["-m", "mpilearn.export", str(tiny_run), "--output", str(out), "--no-check",
            "--precision", "bf16", "--gate-events", "32"]
    proc = mpirun(1, argv)
    assert proc.returncode in (0, 2), proc.stderr
    text = proc.stdout + proc.stderr
    assert "fpd moved" in text and "seed-to-seed spread" in text, text
    bf16 = out / "generator.bf16.pt2"
    if proc.returncode == 2:
        assert not bf16.exists() and "refused" in proc.stderr
        return
    record = json.load(open(out / "generator.bf16.json"))
    assert record["precision"] == "bf16" and record["physics_gate"]["passed"]
    from mpilearn.calo.export import example_inputs
    from mpilearn.calo.runs import load_task, resolve_checkpoint, run_config, shower_model

    checkpoint = resolve_checkpoint(str(tiny_run))
    model = shower_model(load_task(checkpoint, run_config(checkpoint))[0])
    program = torch.export.load(str(bf16)).module()
    inputs = example_inputs(model, 5)
    with torch.inference_mode():
        with torch.autocast("cpu", dtype=torch.bfloat16):  # what generate --precision bf16 runs
            expected = model(*inputs).float()
        got = program(*inputs)
        torch.testing.assert_close(got, expected)
        assert (got - model(*inputs)).abs().max() > 0  # bf16, not fp32
    again = mpirun(1, argv)  # the variant already there is not replaced without --overwrite
    assert again.returncode == 2 and "exists (give --overwrite" in again.stderr, again.stderr


def test_fast_exports_pass_their_gate_and_equal_fast_generation(tiny_run, tmp_path):
    """export --precision bf16-fast / fp32-fast (the generator rewritten for CPU inference):
    gated like the other variants; the program is what generate --precision bf16-fast makes,
    the fp32-fast ONNX file the fp32 function."""
    out = tmp_path / "x"
    proc = mpirun(1, ["-m", "mpilearn.export", str(tiny_run), "--output", str(out), "--no-check",
                      "--precision", "bf16-fast", "--gate-events", "32"])
    assert proc.returncode == 0, proc.stderr
    assert "physics gate passed" in proc.stdout and "fpd moved" in proc.stdout, proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr  # a clean export
    record = json.load(open(out / "generator.bf16-fast.json"))
    assert record["precision"] == "bf16-fast" and record["physics_gate"]["passed"]
    from mpilearn.calo.export import TOLERANCE, check_onnx, fast_variant
    from mpilearn.calo.runs import load_task, resolve_checkpoint, run_config, shower_model

    checkpoint = resolve_checkpoint(str(tiny_run))
    model = shower_model(load_task(checkpoint, run_config(checkpoint))[0])
    # fp32-fast goes through the same write_variant; its ONNX file is the fp32 function
    path, settings = fast_variant(model, str(out), "fp32-fast")
    assert path.endswith("generator.fp32-fast.onnx") and settings["runtime"] == "ONNX Runtime"
    assert check_onnx(path, model) <= TOLERANCE
    args = ("--events", "6", "--batch-size", "4", "--seed", "2", "--energy", "150")
    proc = generate(1, tiny_run, tmp_path / "fast.h5", "--precision", "bf16-fast", *args)
    assert proc.returncode == 0 and "bf16-fast" in proc.stdout, proc.stderr
    program = torch.export.load(str(out / "generator.bf16-fast.pt2")).module()
    task = load_task(checkpoint, run_config(checkpoint))[0]
    task.seed = 2
    with h5py.File(tmp_path / "fast.h5") as f:
        ecal, angle = f["ECAL"][()], f["mtheta"][()]
    inputs = [torch.as_tensor(np.asarray(x, np.float32)) for x in  # generate's first call
              (task.generation_noise(np.arange(2)), np.full(2, 1.5), angle[:2])]
    with torch.inference_mode():
        np.testing.assert_array_equal(program(*inputs).numpy() * 50, ecal[:2])


def test_int8_fast_generation_is_gated_and_alike_at_one_and_two_ranks(tiny_run, tmp_path):
    """generate --precision int8-fast: calibrated the same on every rank, its physics gate run
    before any shower; a broken quantisation (one layer's weight scale 30x) fails that gate."""
    args = ("--events", "5", "--batch-size", "2", "--seed", "1", "--energy", "150",
            "--precision", "int8-fast", "--gate-events", "16")
    runs = {n: generate(n, tiny_run, tmp_path / f"q{n}.h5", *args) for n in (1, 2)}
    for proc in runs.values():
        assert proc.returncode == 0, proc.stderr
        assert "int8-fast physics gate passed: score moved" in proc.stdout, proc.stdout
    with h5py.File(tmp_path / "q1.h5") as one, h5py.File(tmp_path / "q2.h5") as two:
        assert one.attrs["precision"] == "int8-fast"
        for key in one:
            np.testing.assert_array_equal(one[key][()], two[key][()])
    from mpilearn.calo import precision
    from mpilearn.calo.export import latent
    from mpilearn.calo.generate import int8_model
    from mpilearn.calo.int8fast import QuantizedConv3d
    from mpilearn.calo.runs import load_task, resolve_checkpoint, run_config, shower_model

    checkpoint = resolve_checkpoint(str(tiny_run))
    task = load_task(checkpoint, run_config(checkpoint))[0]
    plan = type("Plan", (), {"ranges": json.load(open(tiny_run / "training_ranges.json"))})
    model, meta = int8_model(task, plan)
    broken = next(m for m in model.modules() if isinstance(m, QuantizedConv3d))
    broken.w_scale = broken.w_scale * 30
    fp32 = shower_model(task)
    result = precision.gate(fp32, model, meta, latent(fp32), events=16)
    assert not result["passed"], precision.describe(result)


def test_generate_runs_the_exported_file_alike_at_one_and_two_ranks(tiny_run, tmp_path):
    proc = mpirun(1, ["-m", "mpilearn.export", str(tiny_run), "--output", str(tmp_path / "x"),
                      "--no-check"])
    assert proc.returncode == 0, proc.stderr
    args = ("--events", "10", "--batch-size", "3", "--seed", "5", "--energy", "120", "180")
    onnx_file = tmp_path / "x" / "generator.onnx"
    runs = {"torch": generate(1, tiny_run, tmp_path / "torch.h5", *args)}
    for ranks in (1, 2):
        runs[ranks] = mpirun(ranks, ["-m", "mpilearn.generate", str(onnx_file), "--runtime", "onnx",
                                     "--output", str(tmp_path / f"onnx{ranks}.h5"), "--no-progress",
                                     *args])
    assert all(p.returncode == 0 for p in runs.values()), [p.stderr for p in runs.values()]
    with h5py.File(tmp_path / "torch.h5") as t, h5py.File(tmp_path / "onnx1.h5") as one, \
            h5py.File(tmp_path / "onnx2.h5") as two:
        assert one.attrs["runtime"] == "onnx" and one.attrs["onnx_file"] == str(onnx_file)
        for key in one:  # the same file at 1 and 2 ranks
            np.testing.assert_array_equal(one[key][()], two[key][()])
        ecal, ref = one["ECAL"][()], t["ECAL"][()]
        np.testing.assert_array_equal(one["energy"][()], t["energy"][()])
        peak = ref.reshape(len(ref), -1).max(1)
        worst = (np.abs(ecal - ref).reshape(len(ref), -1).max(1) / peak).max()
        from mpilearn.calo.export import TOLERANCE

        assert worst <= TOLERANCE, worst  # the torch path's showers to the file's precision
    bad = mpirun(1, ["-m", "mpilearn.generate", str(tiny_run), "--runtime", "onnx",
                     "--output", str(tmp_path / "bad.h5"), "--events", "2"])
    assert bad.returncode == 2 and "is not a file" in bad.stderr, bad.stderr


def test_the_full_generator_exports_to_onnx(tmp_path):
    """The reference-size angle generator (untrained): the graph ONNX Runtime must run."""
    from mpilearn.calo.export import TOLERANCE, check_onnx, export_onnx
    from mpilearn.calo.runs import ShowerModel
    from mpilearn.models import gan3d

    model = ShowerModel(gan3d.networks({"preset": "full"})[0], "angle")
    export_onnx(model, str(tmp_path / "full.onnx"))
    assert check_onnx(str(tmp_path / "full.onnx"), model, (1, 3)) <= TOLERANCE


def test_keras_runs_generate_alike_and_are_not_exported(showers_dir, tmp_path):
    run = tmp_path / "keras"
    proc = mpirun(1, train_args("--set", f"model={REPO}/models/gan3d_keras.py",
                                "--set", f"data.files=[{showers_dir}/*.h5]", "--set", "hparams.preset=small",
                                "--set", "train.batch_size=8", "--set", "train.epochs=1",
                                "--set", "train.max_steps_per_epoch=1", "--output", str(run)),
                  env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr
    args = ("--events", "6", "--batch-size", "4", "--energy", "120", "--angle", "80", "100")
    one, two = generate(1, run, tmp_path / "one.h5", *args), generate(2, run, tmp_path / "two.h5", *args)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    with h5py.File(tmp_path / "one.h5") as a, h5py.File(tmp_path / "two.h5") as b:
        assert a["ECAL"].shape == (6, 51, 51, 25) and np.isfinite(a["ECAL"][:]).all()
        np.testing.assert_array_equal(a["ECAL"][:], b["ECAL"][:])
        assert (a["energy"][:] == 120).all()
    proc = mpirun(1, ["-m", "mpilearn.export", str(run)])
    assert proc.returncode == 2 and "Keras" in proc.stderr


def test_a_run_directory_means_its_best_checkpoint_where_there_is_one(tmp_path):
    from mpilearn.calo.runs import resolve_checkpoint
    from mpilearn.train.best import BEST

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for name in ("ckpt-e0001-s0000000.pt", "ckpt-e0002-s0000000.pt"):
        (folder / name).write_bytes(b"x" * 2048)
    (folder / "latest").write_text("ckpt-e0002-s0000000.pt\n")
    assert resolve_checkpoint(str(tmp_path), prefer_best=True).endswith("e0002-s0000000.pt")
    (folder / BEST).write_bytes(b"x" * 2048)  # what train.best writes
    assert resolve_checkpoint(str(tmp_path), prefer_best=True) == str(folder / BEST)
    assert resolve_checkpoint(str(folder), prefer_best=True) == str(folder / BEST)
    assert resolve_checkpoint(str(tmp_path)).endswith("e0002-s0000000.pt")  # validate: latest
    assert resolve_checkpoint(str(folder / "latest")).endswith("e0002-s0000000.pt")
