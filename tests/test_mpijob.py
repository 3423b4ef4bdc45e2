"""The rendered MPIJob's launch path as the MPI Operator runs it (see mpijob_pods.py): two
worker pods running sshd on port 2222, a launcher pod with the operator's host file and
environment running the manifest's own launcher command. No Kubernetes here: the pods are
namespaces on this machine, the runs volume is the shared file system."""
import contextlib
import io
import os
import signal
import time

import subprocess

import pytest
import torch
import yaml

from conftest import ENV, REPO, TESTS, mpirun, train_args
from mpilearn.cluster import jobs
from mpilearn.train import checkpoint as ckpt
from mpijob_pods import MPIJobPods, missing

JOB = "mpilearn-train"


@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    need = missing()
    if os.geteuid() != 0 or need:
        pytest.skip(f"*** MPIJOB TESTS SKIPPED: need root and {', '.join(need) or 'root'} "
                    "(make slurm-packages installs openssh-server) ***")
    root = tmp_path_factory.mktemp("pods")
    worker = rendered(os.path.join(REPO, "jobs", "train-3dgan.yaml"), root)[1]["spec"][
        "mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    cluster = MPIJobPods(str(root), job=JOB).start(worker)
    try:
        yield cluster
    finally:
        cluster.stop()
        assert cluster.processes() == [], "pod processes left running"


@pytest.fixture(scope="module")
def run(tmp_path_factory, toy_file):
    """The config (2 epochs, mid-epoch checkpoints) and what 4 local ranks train from it."""
    root = tmp_path_factory.mktemp("mpijob")
    cfg = {"model": f"{TESTS}/models/slow64.py", "hparams": {"sleep": 0.05},
           "data": {"files": [toy_file]},
           "train": {"epochs": 2, "batch_size": 16, "deterministic": True,
                     "checkpoint_every_steps": 2}}
    config = root / "train.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = mpirun(4, train_args("--config", str(config), "--output", str(root / "local")))
    assert proc.returncode == 0, proc.stderr
    want = ckpt.load(ckpt.latest(str(root / "local" / "checkpoints")))["task"]["models"]["model"]
    return config, want


def rendered(config, workdir):
    """[ConfigMap, MPIJob] for 2 workers x 2 slots."""
    site = workdir / "site.yaml"
    # the pods here see this machine's files: the toy file's folder plays the data volume
    data = yaml.safe_load(open(config))["data"]["files"][0]
    home = os.path.dirname(os.path.dirname(data)) if os.path.isabs(data) else "/work"
    site.write_text(yaml.safe_dump({"kubernetes": {"workers": 2, "slots_per_worker": 2,
                                                   "cpus_per_worker": 2, "workdir": home,
                                                   "image": "mpilearn:test"}}))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert jobs.main(["--target", "kubernetes", "--kind", "train", "--config", str(config),
                          "--site", str(site), "--output", "runs/train"]) == 0
    return list(yaml.safe_load_all(out.getvalue()))


def launcher_command(config, workdir):
    """The rendered manifest's launcher command, with the ConfigMap's files (the config and
    the model file, which travels with it) in their place."""
    config_map, job = rendered(config, workdir)
    assert job["metadata"]["name"] == JOB and job["spec"]["slotsPerWorker"] == 2
    (workdir / "etc-mpilearn").mkdir()
    for name, text in config_map["data"].items():
        (workdir / "etc-mpilearn" / name).write_text(text)
    assert set(config_map["data"]) == {"config.yaml", "slow64.py", "slow.py", "mlp.py"}  # and what it imports
    command = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0][
        "command"]
    return [a.replace("/etc/mpilearn/", f"{workdir}/etc-mpilearn/") for a in command]


def weights(out):
    return ckpt.load(ckpt.latest(str(out / "checkpoints")))["task"]["models"]["model"]


def assert_same(got, want):
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def test_two_workers_of_two_slots_train_what_four_local_ranks_train(pods, run, tmp_path):
    config, want = run
    command = launcher_command(config, tmp_path)
    launcher = pods.launch(command, ENV, str(tmp_path), stdout=-1, stderr=-1, text=True)
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, out + err
    assert f"launcher mpirun (MPIJob {JOB}), 4 process(es); 2 rank(s) on this node" in out, out
    hosts = (tmp_path / "runs" / "train" / f"hosts-{JOB}-launcher").read_text()
    assert hosts == open(pods.hostfile()).read()  # sized from the operator's host file
    assert_same(weights(tmp_path / "runs" / "train"), want)


def test_a_deleted_worker_ends_the_job_and_the_restart_resumes_to_the_same_weights(
        pods, run, tmp_path):
    config, want = run
    command = launcher_command(config, tmp_path)
    log = open(tmp_path / "launcher-1.log", "w")
    launcher = pods.launch(command, ENV, str(tmp_path), stdout=log, stderr=log)
    pointer = tmp_path / "runs" / "train" / "checkpoints" / "latest"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and launcher.poll() is None:
        name = pointer.read_text().strip() if pointer.exists() else ""
        if name.startswith("ckpt-e0001-s") and not name.endswith("s0000000.pt"):
            break  # mid-way through the second epoch
        time.sleep(0.05)
    else:
        launcher.kill()
        pytest.fail("no mid-epoch checkpoint in the second epoch:\n"
                    + open(tmp_path / "launcher-1.log").read())
    killed_at = time.monotonic()
    assert pods.kill_worker(1)
    try:
        rc = launcher.wait(timeout=10)
    except Exception:
        launcher.kill()
        raise AssertionError("the job did not end within 10 s of the worker's death:\n"
                             + open(tmp_path / "launcher-1.log").read())
    took = time.monotonic() - killed_at
    first = open(tmp_path / "launcher-1.log").read()
    assert rc >= 128 and took < 10, (rc, took, first)  # retried under ExitCode
    # one message says what happened and what comes next; no traceback from every rank
    assert first.count("mpilearn: mpirun ended with status") == 1, first
    assert "Traceback" not in first, first
    assert "mpilearn: done" not in first
    # the operator recreates the pod; the launcher restarts (its status is 128+: retried)
    pods.start_worker(1)
    relaunch = pods.launch(command, ENV, str(tmp_path), stdout=-1, stderr=-1, text=True)
    out, err = relaunch.communicate(timeout=300)
    assert relaunch.returncode == 0, out + err
    assert "resum" in out.lower(), out
    assert_same(weights(tmp_path / "runs" / "train"), want)


def wait_for_checkpoint(launcher, out, log, epoch):
    """Until a mid-epoch checkpoint of ``epoch`` (0-based) exists."""
    pointer = out / "checkpoints" / "latest"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and launcher.poll() is None:
        name = pointer.read_text().strip() if pointer.exists() else ""
        if name.startswith(f"ckpt-e{epoch:04d}-s") and not name.endswith("s0000000.pt"):
            return
        time.sleep(0.05)
    launcher.kill()
    pytest.fail(f"no mid-epoch checkpoint in epoch {epoch}:\n" + open(log).read())


def test_kubectl_delete_sigterm_checkpoints_within_the_grace_period_and_resumes(
        pods, run, tmp_path):
    """kubectl delete: SIGTERM to every pod's first process at once. The launcher passes it
    to the ranks (exit 75, state saved); the workers keep their pods until their ranks end."""
    config, want = run
    command = launcher_command(config, tmp_path)
    log = tmp_path / "launcher-1.log"
    launcher = pods.launch(command, ENV, str(tmp_path), stdout=open(log, "w"),
                           stderr=subprocess.STDOUT)
    wait_for_checkpoint(launcher, tmp_path / "runs" / "train", log, 0)
    sent = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    for i in pods.sshd:
        pods.terminate_worker(i)
    rc = launcher.wait(timeout=60)  # well inside the rendered 300 s grace period
    # mpilearn's 75 (state saved), as 143: retried under the operator's ExitCode policy
    assert rc == 143, open(log).read()
    assert "stopped with its state saved; exit 143" in open(log).read()
    for i, worker in list(pods.sshd.items()):
        worker.wait(timeout=30)  # its ranks ended, then sshd: the pod is gone
        pods.sshd.pop(i)
    assert time.monotonic() - sent < 60
    for i in range(len(pods.workers)):  # the job applied again: new pods, same runs volume
        pods.start_worker(i)
    relaunch = pods.launch(command, ENV, str(tmp_path), stdout=-1, stderr=-1, text=True)
    out, err = relaunch.communicate(timeout=300)
    assert relaunch.returncode == 0, out + err
    assert "resum" in out.lower(), out
    assert_same(weights(tmp_path / "runs" / "train"), want)
