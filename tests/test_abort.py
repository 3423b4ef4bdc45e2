"""A crash on one rank ends the whole job with that rank's traceback, never a hang."""
from conftest import TESTS, mpirun, train_args


def test_exception_on_rank1_aborts_4_rank_job(toy_file, tmp_path):
    proc = mpirun(4, train_args("--set", f"model={TESTS}/models/crash.py",
                                "--set", f"data.files=[{toy_file}]", "--set", "train.batch_size=8",
                                "--output", str(tmp_path / "run")), timeout=120)
    assert proc.returncode != 0
    assert proc.seconds < 60, f"took {proc.seconds:.0f}s to end"
    assert "rank 1: " in proc.stderr
    assert "deliberate failure at step 3" in proc.stderr
    # the traceback lines are prefixed with the failing rank, not another one
    failing = [l for l in proc.stderr.splitlines() if "deliberate failure" in l]
    assert all(l.startswith("rank 1: ") for l in failing)


def test_exception_in_single_process_exits_nonzero(toy_file, tmp_path):
    proc = mpirun(1, [f"{TESTS}/scripts/raise.py"], timeout=60)
    assert proc.returncode == 1
    assert "rank 0: " in proc.stderr and "ValueError: boom" in proc.stderr


def test_sys_exit_on_rank1_ends_4_rank_job(toy_file, tmp_path):
    proc = mpirun(4, train_args("--set", f"model={TESTS}/models/crash.py",
                                "--set", "hparams.exit_code=3",
                                "--set", f"data.files=[{toy_file}]", "--set", "train.batch_size=8",
                                "--output", str(tmp_path / "run")), timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.seconds < 60, f"took {proc.seconds:.0f}s to end"
    assert proc.stderr.count("exited with sys.exit(3) while other ranks were still running") == 1
    assert "rank 1: exited with sys.exit(3)" in proc.stderr


def test_a_rank_finishing_late_is_not_aborted():
    # the others reach the end first and wait, as MPI_Finalize would; no abort, status 0
    late = mpirun(3, [f"{TESTS}/scripts/exit_late.py", "3"], timeout=120,
                  env={"MPILEARN_EXIT_WAIT": "1"})
    assert late.returncode == 0, late.stderr[-2000:]
    assert "rank 0 finished its late work" in late.stdout and "aborting" not in late.stderr
    together = mpirun(3, [f"{TESTS}/scripts/exit_late.py", "0.5", "exit"], timeout=120,
                      env={"MPILEARN_EXIT_WAIT": "5"})
    assert together.returncode == 0, together.stderr[-2000:]
