"""Mistakes caught before compute, under real mpirun at np=2: exit status 2, one message from
rank 0 naming the key, file or value, no traceback, quickly; and checkpoints that survive."""
import os

import numpy as np
import pytest

from conftest import REPO, TESTS, mpirun, train_args

MLP = os.path.join(REPO, "models", "mlp.py")


def run(toy_file, out, *extra, model=MLP, np_=2):
    return mpirun(np_, train_args("--set", f"model={model}", "--set", f"data.files=[{toy_file}]",
                                  "--set", "train.batch_size=16", "--output", str(out), *extra),
                  timeout=120)


def assert_bad_input(proc, message, out=None):
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("mpilearn: error:") == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    # before expensive work: nothing trained (below) and no rank left for the watchdog; the
    # bound is a backstop for machines that start ranks twice as slowly as a quiet one
    assert "mpilearn: watchdog:" not in proc.stderr
    assert proc.seconds < 100
    if out is not None:
        assert not (out / "metrics.jsonl").exists()  # nothing was trained


def h5(path, **datasets):
    import h5py

    with h5py.File(path, "w") as f:
        for key, value in datasets.items():
            if value is None:
                f.create_group(key).create_dataset("inner", data=np.zeros(3))
            else:
                f[key] = value
    return str(path)


CASES = [
    (["--set", "train.seed=-1"], "'train.seed' must be in [0, 2**32), got -1", MLP),
    (["--set", "hparams.optimizer=adamw"],
     "hparams.optimizer is 'adamw': not one of 'adam', 'sgd'; did you mean 'adam'?", MLP),
    (["--set", "hparams.layers=1.5"], "hparams.layers is 1.5: must be an integer in [0, inf)", MLP),
    (["--set", "hparams.preset=smal"], "hparams.preset is 'smal': not one of 'full', 'small', 'smooth'; "
     "did you mean 'small'?", f"{REPO}/models/gan3d.py"),
    ([], "build(hparams) returned dict, expected a task", f"{TESTS}/models/wrong_type.py"),
    (["--set", "hparams.features=10"], "the data do not fit the model: a batch of", MLP),
    (["--set", "train.early_stopping.patience=2", "--set", "train.early_stopping.monitor=val_los"],
     "train.early_stopping.monitor 'val_los' is not a metric this run logs (did you mean "
     "'val_loss'?)", MLP),
    (["--set", "train.best.monitor=samples_per_s"], "train.best.mode is needed for monitor "
     "'samples_per_s' (min or max): the direction is inferred only for", MLP),
    (["--set", "train.best.monitor=val_los"], "train.best.monitor 'val_los' is not a metric "
     "this run logs (did you mean 'val_loss'?)", MLP),
    (["--set", "train.precision=bf16"], "train.precision=bf16 is for PyTorch models; for a "
     "Keras model call keras.mixed_precision.set_global_policy('mixed_bfloat16')",
     f"{REPO}/models/keras_mlp.py"),
    (["--set", "train.precision=fp16"], "train.precision", MLP),
    (["--set", "train.backend=torch"], "train.backend=torch is for PyTorch models; a Keras "
     "model's gradients travel through mpi4py", f"{REPO}/models/keras_mlp.py"),
    (["--set", "train.fusion_mb=4"], "train.fusion_mb=4 is for PyTorch models",
     f"{REPO}/models/keras_mlp.py"),
]


@pytest.mark.parametrize("extra,message,model", CASES, ids=[c[1][:40] for c in CASES])
def test_config_and_builder_mistakes(toy_file, tmp_path, extra, message, model):
    out = tmp_path / "run"
    assert_bad_input(run(toy_file, out, *extra, model=model), message, out)


def test_the_plan_reports_the_first_mistake_before_anything_is_written(toy_file, tmp_path):
    """The driver checks everything in one plan step (``train/plan.py``): of two mistakes the
    one met first (the model's hyperparameters before the monitored metric) is the message,
    and the run directory is not even created."""
    out = tmp_path / "run"
    proc = run(toy_file, out, "--set", "train.best.monitor=val_los",
               "--set", "hparams.optimizer=adamw")
    assert_bad_input(proc, "hparams.optimizer is 'adamw'", out)
    assert "val_los" not in proc.stderr and not out.exists()
    proc = run(toy_file, out, "--set", "train.algorithm=downpour", "--set",
               "train.lr_scaling=none", np_=1)
    assert_bad_input(proc, "train.algorithm=downpour needs at least 2 ranks", out)
    assert not out.exists()


def test_output_that_is_a_file(toy_file, tmp_path):
    target = tmp_path / "afile"
    target.write_text("not a directory")
    assert_bad_input(run(toy_file, target), f"--output {target} is a file, not a directory")
    assert target.read_text() == "not a directory"  # untouched


def test_data_paths_that_are_not_files(toy_file, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    proc = mpirun(2, train_args("--set", f"model={MLP}", "--set", f"data.files=[{folder}]",
                                "--output", str(tmp_path / "a")), timeout=120)
    assert_bad_input(proc, f"data.files: {folder} is a directory: give the files in it")
    proc = mpirun(2, train_args("--set", f"model={MLP}", "--set", f"data.files=[{folder}/*.h5]",
                                "--output", str(tmp_path / "b")), timeout=120)
    # the key, not the garbled "data file the pattern ..." (issue 48)
    assert_bad_input(proc, f"data.files: the pattern {folder}/*.h5 matches no file")


def test_hdf5_key_that_is_a_group(tmp_path):
    path = h5(tmp_path / "group.h5", X=np.zeros((64, 8), np.float32), y=None)
    proc = mpirun(2, train_args("--set", f"model={MLP}", "--set", f"data.files=[{path}]",
                                "--output", str(tmp_path / "run")), timeout=120)
    assert_bad_input(proc, f"{path}: 'y' is an HDF5 group, not a dataset (it holds: inner)")


def test_argparse_errors_are_printed_once(tmp_path):
    proc = mpirun(2, ["-m", "mpilearn.train", "--no-such-flag"], timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("unrecognized arguments: --no-such-flag") == 1, proc.stderr


def test_resume_of_another_model_names_the_tensor(toy_file, tmp_path):
    out = tmp_path / "run"
    assert run(toy_file, out, "--set", "train.max_steps_per_epoch=2").returncode == 0
    proc = run(toy_file, out, "--set", "hparams.hidden=16", "--resume")  # the config says so
    assert_bad_input(proc, "hparams.hidden: (unset) -> 16")
    proc = run(toy_file, out, "--set", "hparams.hidden=16", "--resume", "--force")  # the weights too
    assert_bad_input(proc, "is not a checkpoint of this model and optimizer")
    assert "size mismatch for 0.weight" in proc.stderr


def test_truncated_latest_resumes_from_the_previous_checkpoint(toy_file, tmp_path):
    from mpilearn.train.checkpoint import latest

    out = tmp_path / "run"
    first = run(toy_file, out, "--set", "train.epochs=2", "--set", "train.max_steps_per_epoch=2")
    assert first.returncode == 0, first.stderr
    newest = latest(str(out / "checkpoints"))
    with open(newest, "r+b") as f:
        f.truncate(os.path.getsize(newest) // 2)
    (out / "checkpoints" / ".tmp-ckpt-killed").write_bytes(b"x" * 1000)  # a killed write
    proc = run(toy_file, out, "--set", "train.epochs=3", "--set", "train.max_steps_per_epoch=2",
               "--resume")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"checkpoint {newest} does not load" in proc.stdout
    assert "resumed from" in proc.stdout and "ckpt-e0001-s0000000.pt" in proc.stdout
    assert "removed" in proc.stdout and not (out / "checkpoints" / ".tmp-ckpt-killed").exists()


def corrupt_file(tmp_path) -> str:
    """256 events, X gzip-compressed in chunks of 32; the chunk of events 96-127 corrupt."""
    import h5py

    path = str(tmp_path / "corrupt.h5")
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f.create_dataset("X", data=rng.normal(size=(256, 8)).astype(np.float32), chunks=(32, 8),
                         compression="gzip")
        f["y"] = rng.normal(size=(256, 1)).astype(np.float32)
    with h5py.File(path, "r") as f:
        offset = f["X"].id.get_chunk_info(3).byte_offset  # events 96-127
    with open(path, "r+b") as f:
        f.seek(offset + 10)
        f.write(b"\xff" * 64)
    return path


def test_corrupt_gzip_chunk_names_file_and_events(tmp_path):
    path = corrupt_file(tmp_path)
    proc = mpirun(2, train_args("--set", f"model={MLP}", "--set", f"data.files=[{path}]",
                                "--set", "data.shuffle=false", "--set", "train.batch_size=16",
                                "--output", str(tmp_path / "run")), timeout=150)
    # fast: not a rank left waiting until the watchdog ends it (60 s after its last step).
    # The bound alone was 60 s, and met 69 s under a loaded suite (start-up took most of it)
    assert proc.returncode != 0 and proc.seconds < 100, proc.seconds
    assert "no progress for" not in proc.stderr, proc.stderr[-2000:]
    assert f"{path}: reading dataset 'X', events" in proc.stderr, proc.stderr[-2000:]


def test_a_corrupt_chunk_read_by_both_ranks_is_one_message_then_skip_resumes(tmp_path):
    """Unshuffled, no validation split: step 3 reads events 96-111 on rank 0 and 112-127 on
    rank 1, all in the corrupt chunk. Both ranks fail; the job says so once, saves the
    position before that step, and continues from it with data.on_error=skip."""
    import json

    path = corrupt_file(tmp_path)
    out = tmp_path / "run"
    base = ["--set", f"model={MLP}", "--set", f"data.files=[{path}]", "--set",
            "data.shuffle=false", "--set", "data.val_fraction=0", "--set", "train.batch_size=16",
            "--output", str(out)]
    proc = mpirun(2, train_args(*base), timeout=120)
    both = proc.stdout + proc.stderr
    assert proc.returncode == 3, both[-3000:]
    assert both.count(f"{path}: reading dataset 'X'") == 1, both
    assert f"{path}: reading dataset 'X', events 96-127 of this file failed on ranks 0, 1" in proc.stderr
    assert "Traceback" not in both and "data.on_error=skip" in proc.stderr
    from mpilearn.train.checkpoint import latest, load

    state = load(latest(str(out / "checkpoints")))
    assert (state["epoch"], state["step_in_epoch"]) == (0, 3)  # the steps before the bad one
    proc = mpirun(2, train_args(*base, "--set", "data.on_error=skip", "--resume"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert "stopped" in records[0] and records[-1]["epoch"] == 1


def test_a_failed_write_names_the_file_and_keeps_the_old_one(tmp_path):
    import errno

    from mpilearn.core.io import WriteError, atomic_write_bytes

    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"previous")

    def full_disk(f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(WriteError, match=f"writing {path} failed: no space left on device"):
        atomic_write_bytes(str(path), full_disk)
    assert path.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temp file left


def test_outputs_honour_the_umask(toy_file, tmp_path):
    import stat

    old = os.umask(0o022)
    try:
        out = tmp_path / "run"
        proc = run(toy_file, out, "--set", "train.max_steps_per_epoch=2", np_=1)
    finally:
        os.umask(old)
    assert proc.returncode == 0, proc.stderr
    from mpilearn.train.checkpoint import latest

    for path in (out / "config.yaml", out / "checkpoints" / "latest",
                 latest(str(out / "checkpoints"))):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o644, path


def test_data_on_error_skip_trains_on_and_says_what_it_skipped(tmp_path):
    path = corrupt_file(tmp_path)
    out = tmp_path / "run"
    proc = mpirun(2, train_args("--set", f"model={MLP}", "--set", f"data.files=[{path}]",
                                "--set", "data.shuffle=false", "--set", "train.batch_size=16",
                                "--set", "data.on_error=skip", "--set", "train.epochs=2",
                                "--output", str(out)), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"data.on_error=skip: {path}: reading dataset 'X', events" in proc.stderr
    import json

    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(records) == 2 and all(np.isfinite(r["train_loss"]) for r in records)
