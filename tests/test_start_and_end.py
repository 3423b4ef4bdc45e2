"""The first seconds and the last line (issue 34): every CLI's --help without torch or
TensorFlow; a stop signal during the ranks' start-up ends with one mpilearn line, no signal
name from the launcher, and status 75; a sweep whose every trial failed exits 4, its last
line saying why and where; the launchers' own block quieted where a switch exists."""
import glob
import os
import subprocess
import sys
import time

import pytest

from conftest import ENV, REPO, TESTS, mpirun

CLIS = ("train", "optimize", "jobs", "generate", "validate", "export", "simulate", "refit",
        "report", "run")

# runs ``python -m MODULE --help`` with importing torch, tensorflow or keras raising; an import
# tried and swallowed (an optional dependency probed) still fails the run, at exit
NO_FRAMEWORKS = r"""
import atexit, os, runpy, sys
tried = []
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "tensorflow", "keras"):
            tried.append(name)
            raise ImportError(f"importing {name} is refused here")
def report():
    if tried:
        sys.stderr.write(f"imported {sorted(set(tried))}\n")
        sys.stderr.flush()
        os._exit(97)
atexit.register(report)
sys.meta_path.insert(0, Refuse())
sys.argv = [sys.argv[1], "--help"]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("cli", CLIS)
def test_help_imports_no_framework(cli):
    proc = subprocess.run([sys.executable, "-c", NO_FRAMEWORKS, f"mpilearn.{cli}"], cwd=REPO,
                          env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:") and "--help" in proc.stdout, proc.stdout


def _ranks_of(launcher_pid):
    """The rank processes under mpilearn-run (its child is mpirun; theirs, the ranks)."""
    pids = []
    for parent in subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True,
                                 text=True).stdout.split():
        pids += subprocess.run(["pgrep", "-P", parent], capture_output=True,
                               text=True).stdout.split()
    return pids


def test_ctrl_c_to_mpilearn_run_during_the_ranks_imports(toy_file, tmp_path):
    """Ctrl-C as soon as the ranks exist (still importing): before this fix the forwarded
    SIGUSR1 killed them ("exited on signal 10 (User defined signal 1)", exit 138)."""
    import signal

    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "mpilearn.run", "-np", "2", sys.executable, "-m",
           "mpilearn.train", "--no-progress", "--set", f"model={TESTS}/models/slow.py",
           "--set", f"data.files=[{toy_file}]", "--set", "train.epochs=1", "--output", out]
    job = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while len(_ranks_of(job.pid)) < 2 and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.01)
    job.send_signal(signal.SIGINT)
    output, _ = job.communicate(timeout=120)
    assert job.returncode == 75, output
    ours = [l for l in output.splitlines() if l.startswith("mpilearn") and "stopped" in l]
    assert ours == ["mpilearn: stopped by SIGINT before the first step; nothing to save; run "
                    "again with --resume auto"], output
    assert "signal 10" not in output and "User defined signal" not in output, output
    assert "SIGUSR1" not in output and "Traceback" not in output, output
    assert not glob.glob(os.path.join(out, "**", "*.pt"), recursive=True)  # nothing saved


def test_a_sweep_whose_every_trial_failed_exits_4_naming_the_most_common_failure(tmp_path):
    """A real sweep whose three trials all fail, two by raising and one by returning NaN:
    status 4, and the last line names the commoner failure and where the last trial that
    failed so has its traceback and output (tests/test_hpo.py: a training sweep, all timed
    out)."""
    import json

    import yaml

    out = tmp_path / "sweep"
    cfg = {"output": str(out),
           "search": {"searcher": "random", "budget": 3, "blocks": 1, "folds": 1,
                      "objective": {"function": "objectives:fragile"},
                      "space": {"x": {"type": "real", "low": 0, "high": 1}},
                      "enqueue": [{"x": 0.9}, {"x": 0.1}, {"x": 0.95}]}}
    path = tmp_path / "hpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = mpirun(2, ["-m", "mpilearn.optimize", "--config", str(path), "--no-progress"],
                  env={"PYTHONPATH": TESTS})
    assert proc.returncode == 4, proc.stderr
    events = [json.loads(l) for l in open(out / "journal.jsonl")]
    failed = [e for e in events if e["event"] == "failed"]
    assert len(failed) == 3 and not any(e["event"] == "done" for e in events)
    raised = [e for e in failed if e["reason"].startswith("RuntimeError: builder exploded")]
    assert len(raised) == 2
    key = raised[-1]["key"]
    # mpilearn's last line (Open MPI 5 adds its own block after it: README)
    last = [l for l in proc.stderr.splitlines() if l.startswith("mpilearn")][-1]
    assert last == (
        "mpilearn: sweep failed: no trial succeeded: 2 of 3 failed with RuntimeError: builder "
        f"exploded; the last of them, trial {key}, has its traceback in {out}/journal.jsonl "
        f"(its 'failed' event), its output in the lines marked [trial {key} fold N]"), proc.stderr
    assert "builder exploded" in raised[-1]["reason"] and "objectives.py" in raised[-1]["reason"]


def test_mpilearn_run_quiets_the_launchers_that_can_be_quieted():
    """Open MPI 4's orterun takes --quiet (no block after mpilearn's message); Open MPI 5 and
    Hydra have no such switch, and get none."""
    from mpilearn.cluster.run import build_command, flavour_of

    here = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    assert flavour_of(here) == "openmpi" and "(Open MPI) 5." in here, here
    assert flavour_of("mpirun (Open MPI) 4.1.6\n\nReport bugs to ...") == "openmpi-orte"
    assert flavour_of("HYDRA build details:\n    Version: 4.2.0") == "hydra"
    orte = build_command(2, None, ["python", "t.py"], env={}, flavour="openmpi-orte")
    assert "--quiet" in orte and orte[-2:] == ["python", "t.py"]
    for flavour in ("openmpi", "hydra"):
        assert "--quiet" not in build_command(2, None, ["python"], env={}, flavour=flavour)
