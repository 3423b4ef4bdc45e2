"""Every stop signal checkpoints and says so (issue 28): SIGINT and SIGTERM to the launcher
(through mpilearn-run, which the project controls: Open MPI's mpirun would SIGKILL the ranks
0.5 s after either) or straight to the ranks (what srun, Hydra and scancel deliver) end a real
2-rank job at the next step with one line, exit 75, and --resume auto ends where an
uninterrupted run ends, bitwise."""
import glob
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ENV, REPO, mpirun, mpirun_cmd, wait_until_gone
from mpilearn.train import checkpoint as ckpt
# the slow MLP run and its uninterrupted result (the module fixture ``whole``)
from test_resume import args, final_weights, whole  # noqa: F401


def signal_during_training(cmd, out, send):
    """Starts ``cmd``; once the first epoch is logged, ``send(job)``; returns (rc, output)."""
    job = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not os.path.exists(metrics) and job.poll() is None:
        time.sleep(0.05)
    if job.poll() is None:
        send(job)
    output, _ = job.communicate(timeout=120)
    return job.returncode, output


def assert_stopped_and_resumes(toy_file, out, whole, rc, output, name):
    assert rc == 75, output
    lines = [l for l in output.splitlines() if "stopped by" in l]
    assert len(lines) == 1, output  # one message, from rank 0
    assert lines[0].startswith(f"mpilearn: stopped by {name}; checkpoint {out}/checkpoints/ckpt-")
    assert lines[0].endswith("; continue with --resume auto")
    assert "Traceback" not in output
    stopped = ckpt.load(ckpt.latest(os.path.join(out, "checkpoints")))
    assert stopped["epoch"] < 3 and stopped["step_in_epoch"] > 0  # mid-epoch: the next step
    assert lines[0].split("checkpoint ")[1].split(";")[0] == ckpt.latest(os.path.join(out, "checkpoints"))
    proc = mpirun(2, args(toy_file, out) + ["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr
    got, want = final_weights(out), final_weights(whole)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_to_mpilearn_run_checkpoints_once_and_exits_75(toy_file, tmp_path, whole, sig):
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "mpilearn.run", "-np", "2", "--mpi-args=--oversubscribe",
           sys.executable] + args(toy_file, out)
    rc, output = signal_during_training(cmd, out, lambda job: job.send_signal(sig))
    assert_stopped_and_resumes(toy_file, out, whole, rc, output, sig.name)


def test_kill9_of_mpilearn_run_ends_its_job(toy_file, tmp_path):
    """No handler sees a SIGKILL: mpirun, in its own process group, gets the parent-death
    SIGTERM and ends the ranks (before, they trained on, orphaned)."""
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "mpilearn.run", "-np", "2", "--mpi-args=--oversubscribe",
           sys.executable] + args(toy_file, out) + ["--set", "train.epochs=100"]
    rc, _ = signal_during_training(cmd, out, lambda job: job.send_signal(signal.SIGKILL))
    assert rc == -signal.SIGKILL
    wait_until_gone(out, timeout=20)  # 100 epochs take minutes
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert sum('"time"' in line for line in f) < 100  # ended, not finished


def test_sigterm_to_every_rank_under_mpirun_exits_75(toy_file, tmp_path, whole):
    """What scancel (all of a step's processes), srun and mpiexec (forwarding) deliver."""
    out = str(tmp_path / "run")

    def to_ranks(job):
        ranks = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True)
        pids = [int(p) for p in ranks.stdout.split()]
        assert len(pids) == 2, ranks.stdout
        for pid in pids:
            os.kill(pid, signal.SIGTERM)

    rc, output = signal_during_training(mpirun_cmd(2, args(toy_file, out)), out, to_ranks)
    assert_stopped_and_resumes(toy_file, out, whole, rc, output, "SIGTERM")


def test_ctrl_c_to_a_single_process_run_checkpoints(toy_file, tmp_path, whole):
    """``python -m mpilearn.train`` without a launcher: Ctrl-C is a stop signal too."""
    out = str(tmp_path / "run")
    cmd = [sys.executable] + args(toy_file, out)
    rc, output = signal_during_training(cmd, out, lambda job: job.send_signal(signal.SIGINT))
    assert rc == 75, output
    assert output.count(f"mpilearn: stopped by SIGINT; checkpoint {out}/checkpoints/ckpt-") == 1


LEAVING = """
import os, signal, sys
from mpilearn.cluster import preempt
preempt.install()
os.kill(os.getpid(), signal.SIGTERM)    # the stop: recorded by the handler
status = preempt.leave()
# what Python does in its last steps: a handler it installed goes back to the default, an
# ignored signal stays ignored (CPython's _PySignal_Fini)
for sig in (signal.SIGTERM, signal.SIGUSR1):
    if signal.getsignal(sig) not in (signal.SIG_IGN, signal.SIG_DFL):
        signal.signal(sig, signal.SIG_DFL)
os.kill(os.getpid(), signal.SIGTERM)    # the launcher's signal to a rank that is leaving
os.kill(os.getpid(), signal.SIGUSR1)
sys.exit(status)
"""


def test_a_rank_leaving_with_its_state_saved_is_not_killed_by_the_launchers_signal():
    """CI saw srun kill a rank that was exiting 75 (its faster peers had exited 75, and
    --kill-on-bad-exit signalled the step after Python had put the default handler back):
    the job read as killed, not stopped. A rank that leaves with its state saved ignores
    SIGTERM and SIGUSR1 from then on."""
    proc = subprocess.run([sys.executable, "-c", LEAVING], env=ENV, cwd=REPO, timeout=60,
                          capture_output=True, text=True)
    assert proc.returncode == 75, (proc.returncode, proc.stderr)


def test_a_signal_after_the_last_epoch_leaves_the_finished_run_at_status_0(toy_file, tmp_path):
    """Issue 48: a SIGINT to mpilearn-run as a run ended (its ranks tearing the interpreter
    down, the default handlers back) killed them with the forwarded SIGUSR1, and the finished
    run, models written, exited 75: 'requeue me'. The model file's ranks linger in that
    teardown (tests/models/slow_exit.py) and say so, so the signal lands exactly there."""
    marker, out = str(tmp_path / "exiting"), str(tmp_path / "run")
    cmd = [sys.executable, "-m", "mpilearn.run", "-np", "2", "--mpi-args=--oversubscribe",
           sys.executable, "-m", "mpilearn.train", "--no-progress",
           "--set", f"model={REPO}/tests/models/slow_exit.py", "--set", f"data.files=[{toy_file}]",
           "--set", "train.epochs=2", "--set", "train.max_steps_per_epoch=2",
           "--set", f"hparams.exit_marker={marker}", "--output", out]
    job = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while len(glob.glob(marker + ".*")) < 2 and job.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.poll() is None, job.communicate()[0]
    job.send_signal(signal.SIGINT)
    output, _ = job.communicate(timeout=120)
    assert job.returncode == 0, output
    assert "mpilearn: done after 2 epoch(s)" in output
    assert "stopped by" not in output and "nothing saved" not in output
    assert "mpilearn-run: SIGINT came as the job was ending; it had finished (status 0)" in output
    assert os.path.exists(os.path.join(out, "models", "model.pt"))
