"""containers/Containerfile built and run with podman (marker ``image``; `make image-test`, and
`make test` runs it in a process of its own beside the rest).

No container registry is reachable here, so the base is a local Debian bookworm made once with
mmdebstrap and imported as localhost/debian-base:bookworm (the Containerfile's default base,
debian:bookworm-slim, is what a user pulls). podman runs with runc and a containers.conf that
clears the default ulimits (crun and podman's default ulimits fail on this machine: see
docs/guide/kubernetes.md, "Building and testing the image here"). Inside the image, as its
user (UID 1000) with a run directory mounted from the host: one demo epoch at np=2, and the
launcher command of a rendered MPIJob, once with the operator's host file naming the launcher's
own container (-np 2, no ssh), once with a worker container on a podman network running the
rendered worker command (sshd) and the ranks started there over ssh. Needs root and podman, buildah, runc and mmdebstrap (`make image-test`
installs them): without them the tests FAIL, saying so, never skip.

The base's tar is kept in ~/.cache/mpilearn/images/ (MPILEARN_CACHE) and podman keeps the
image's layers: a second run rebuilds nothing unless the build context changed (a changed
file under mpilearn/ reruns install.sh's layer: pip downloads torch again)."""
import contextlib
import glob
import io
import os
import shutil
import socket
import stat
import subprocess
import time
import types

import pytest
import yaml

from conftest import REPO

pytestmark = pytest.mark.image

CACHE = os.path.join(os.environ.get("MPILEARN_CACHE") or os.path.expanduser("~/.cache/mpilearn"),
                     "images")
BASE = "localhost/debian-base:bookworm"
BASE_TAR = os.path.join(CACHE, "debian-bookworm-minbase.tar")
IMAGE = "localhost/mpilearn:image-test"
# torch's extra (cloudpickle) instead of the default hpo,keras: keras pulls tensorflow-cpu
# (hundreds of MB more to download and unpack, minutes of a cold build) and the runs below
# use neither the searchers nor Keras
EXTRAS = "torch"
UID = 1000
TOOLS = ("podman", "buildah", "runc", "mmdebstrap")
BUILD_TIMEOUT = 20 * 60
RUN_TIMEOUT = 10 * 60
# containers this module starts (removed at the end whatever happened)
NAMES = ("mpilearn-imgtest-check", "mpilearn-imgtest-demo", "mpilearn-imgtest-launcher",
         "mpilearn-imgtest-worker")
# the two-container MPIJob's network (podman's CNI bridge; static addresses: no DNS plugin here)
NETWORK, SUBNET = "mpilearn-imgtest", "10.89.7"
CONTAINERS_CONF = "[containers]\ndefault_ulimits = []\npids_limit = 0\n"
# This machine's pip set-up travels into the build as read-only mounts of the build alone (none
# of it stays in the image): TLS goes through a proxy with its own CA (pip checks against the
# system bundle: /etc/pip.conf's cert), and download.pytorch.org does not resolve, so torch's CPU
# wheel comes from the local wheel directory (find-links), the rest from PyPI
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
HOST_WHEELS = os.environ.get("PIP_FIND_LINKS", "/opt/wheels").split()[0]
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


def _tail(text, n=4000):
    return text if len(text) <= n else "...\n" + text[-n:]


class Podman:
    """``podman --runtime runc`` with the containers.conf that clears the default ulimits."""

    def __init__(self, conf_dir):
        self.conf = os.path.join(conf_dir, "containers.conf")
        with open(self.conf, "w") as f:
            f.write(CONTAINERS_CONF)
        self.env = {**os.environ, "CONTAINERS_CONF": self.conf}

    def __call__(self, *args, timeout=120, what=None, check=True):
        cmd = ["podman", "--runtime", "runc", *args]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  env=self.env, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
                else (e.stdout or "")
            pytest.fail(f"{what or 'podman ' + args[0]}: no end after {timeout} s\n"
                        f"$ {' '.join(cmd)}\n{_tail(out)}")
        proc.seconds = time.monotonic() - start
        if check and proc.returncode != 0:
            pytest.fail(f"{what or 'podman ' + args[0]} failed (status {proc.returncode}, "
                        f"{proc.seconds:.0f} s)\n$ {' '.join(cmd)}\n"
                        f"--- stdout\n{_tail(proc.stdout)}\n--- stderr\n{_tail(proc.stderr)}")
        return proc

    def run(self, name, *args, timeout=RUN_TIMEOUT, what=None, check=True, network="host"):
        """``podman run --rm`` as the image's user, on the host's network (or ``network``);
        removed afterwards even when the client was killed by the timeout."""
        try:
            return self("run", "--rm", "--name", name, f"--network={network}", "--user",
                        str(UID), *args, timeout=timeout, what=what, check=check)
        finally:
            self.remove(name)

    def remove(self, name):
        subprocess.run(["podman", "--runtime", "runc", "rm", "-f", "-t", "2", "--ignore", name],
                       capture_output=True, env=self.env, timeout=120)


@pytest.fixture(scope="module")
def podman(tmp_path_factory):
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pytest.fail(f"*** IMAGE TESTS FAILED: {', '.join(missing)} not installed. `make "
                    "image-test` installs podman, buildah, runc and mmdebstrap from the "
                    "distribution as root; " + ("run through it, as root, the install failed: "
                    "see its output" if os.geteuid() == 0 else "this is not root") + " ***")
    if os.geteuid() != 0:
        pytest.fail("*** IMAGE TESTS FAILED: they need root (rootful podman, mmdebstrap) ***")
    p = Podman(str(tmp_path_factory.mktemp("podman")))
    yield p
    for name in NAMES:
        p.remove(name)
    p("network", "rm", "-f", NETWORK, check=False)


@pytest.fixture(scope="module")
def base(podman):
    """localhost/debian-base:bookworm: podman's, else imported from the cached tar, else the
    tar made first with mmdebstrap (~1.5 min, ~180 MB)."""
    if podman("image", "exists", BASE, check=False).returncode == 0:
        return BASE
    if not os.path.exists(BASE_TAR):
        os.makedirs(CACHE, exist_ok=True)
        partial = BASE_TAR + ".partial"
        if os.path.exists(partial):  # a killed run's
            os.remove(partial)
        cmd = ["mmdebstrap", "--variant=minbase", "--format=tar", "--include=ca-certificates",
               "bookworm", partial]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=15 * 60,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            pytest.fail(f"mmdebstrap made no base in 15 min\n$ {' '.join(cmd)}")
        if proc.returncode != 0:
            pytest.fail(f"mmdebstrap failed (status {proc.returncode})\n$ {' '.join(cmd)}\n"
                        f"{_tail(proc.stdout + proc.stderr)}")
        os.replace(partial, BASE_TAR)  # a killed run leaves no tar that looks whole
    podman("import", "-q", BASE_TAR, BASE, timeout=600, what=f"podman import {BASE_TAR}")
    return BASE


def resolves(host):
    try:
        socket.getaddrinfo(host, 443)
        return True
    except OSError:
        return False


def build_mounts(tmp):
    """(podman build's -v and --build-arg options, what they are) for this machine's pip."""
    conf, opts, note = ["[global]"], [], []
    if os.path.exists(HOST_CA):
        opts += ["-v", f"{HOST_CA}:/tmp/host-pip/ca.crt:ro"]
        conf.append("cert = /tmp/host-pip/ca.crt")
        note.append(f"pip trusts {HOST_CA}")
    torch_index = TORCH_INDEX
    if not resolves("download.pytorch.org"):
        wheels = glob.glob(os.path.join(HOST_WHEELS, "torch-*+cpu-cp311-*manylinux*x86_64.whl"))
        if not wheels:
            pytest.fail("download.pytorch.org does not resolve here and no torch CPU wheel for "
                        f"Python 3.11 is in {HOST_WHEELS} (PIP_FIND_LINKS): the image's torch "
                        "has nowhere to come from")
        opts += ["-v", f"{HOST_WHEELS}:/tmp/host-wheels:ro"]
        conf.append("find-links = /tmp/host-wheels")
        # torch==X then matches the local X+cpu wheel (a local version sorts above PyPI's X)
        torch_index = "https://pypi.org/simple"
        note.append(f"torch from {os.path.basename(wheels[0])}")
    with open(os.path.join(tmp, "pip.conf"), "w") as f:
        f.write("\n".join(conf) + "\n")
    opts += ["-v", f"{os.path.join(tmp, 'pip.conf')}:/etc/pip.conf:ro",
             "--build-arg", f"TORCH_INDEX={torch_index}"]
    return opts, note


@pytest.fixture(scope="module")
def image(podman, base, tmp_path_factory, pytestconfig):
    mounts, note = build_mounts(str(tmp_path_factory.mktemp("build")))
    containerfile = os.path.join(REPO, "containers", "Containerfile")
    proc = podman("build", "--network=host", "-f", containerfile,
                  "--build-arg", f"BASE={base}", "--build-arg", f"EXTRAS={EXTRAS}", *mounts,
                  "-t", IMAGE, REPO, timeout=BUILD_TIMEOUT,
                  what="podman build -f containers/Containerfile")
    cached, steps = proc.stdout.count("Using cache"), proc.stdout.count("STEP ")
    # on the terminal, passed or not: whether the layer cache held is the run's main cost
    with pytestconfig.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print(f"\nimage {IMAGE} built in {proc.seconds:.0f} s ({cached} of {steps} steps "
              f"cached; {'; '.join(note) or 'no host pip set-up'})", flush=True)
    return IMAGE


def world_writable(path):
    """A host directory the image's user (UID 1000) writes into, as a runs volume is."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)
    return path


def test_the_image_runs_as_uid_1000_and_holds_no_checkout_junk(podman, image):
    proc = podman.run(
        NAMES[0], image, "sh", "-c",
        'id -u; id -un; command -v python; command -v mpirun; '
        'for p in /src/mpilearn/.venv /src/mpilearn/.git /src/mpilearn/runs /src/mpilearn/data '
        '  /src/mpilearn/.pytest_cache; do test ! -e "$p" || echo "JUNK $p"; done; '
        # the build's mounts leave their (empty) mount points, nothing of what they held
        'find /tmp/host-pip /tmp/host-wheels -mindepth 1 ! -empty 2>/dev/null | sed "s/^/JUNK /"; '
        'test ! -s /etc/pip.conf || echo "JUNK /etc/pip.conf"; '
        'python -c "import mpilearn, torch, mpi4py.MPI as M; '
        'print(mpilearn.__version__, torch.__version__, M.Get_library_version().split(chr(10))[0])"',
        what="the image's user and contents")
    lines = proc.stdout.splitlines()
    assert lines[:2] == [str(UID), "mpiuser"], proc.stdout
    assert lines[2:4] == ["/opt/mpilearn/bin/python", "/usr/bin/mpirun"], proc.stdout
    assert not [l for l in lines if l.startswith("JUNK")], proc.stdout
    assert "Open MPI" in lines[-1] and "+cpu" in lines[-1], proc.stdout


def test_a_demo_epoch_at_np2_in_the_image_writes_the_mounted_run_as_uid_1000(
        podman, image, tmp_path):
    runs = world_writable(tmp_path / "runs")
    proc = podman.run(
        NAMES[1], "-v", f"{runs}:/work/runs", "-e", "OMP_NUM_THREADS=1", image,
        "mpirun", "-np", "2", "--oversubscribe", "python", "-m", "mpilearn.train",
        "--no-progress", "--demo", "--output", "runs/demo", "--set", "train.epochs=1",
        "--set", "train.max_steps_per_epoch=2", "--set", "train.physics_events=32",
        what="the demo at np=2 in the image")
    demo = runs / "demo"
    for name in ("config.yaml", "metrics.jsonl", "models/generator.safetensors"):
        assert (demo / name).exists(), f"{name} missing in the mounted run\n{_tail(proc.stdout)}"
    # rootful podman maps no user namespace: UID 1000 in the container is UID 1000 on the
    # host, and the files are readable there (by the host's root and by everyone: 0644)
    for path in [demo, *demo.rglob("*")]:
        st = path.stat()
        assert st.st_uid == UID, f"{path} is owned by UID {st.st_uid} on the host, not {UID}"
        assert st.st_mode & stat.S_IROTH, f"{path} is not readable on the host: {oct(st.st_mode)}"
    with open(demo / "metrics.jsonl") as f:
        assert f.read().strip(), "metrics.jsonl is empty"
    inside = podman.run(NAMES[1], "-v", f"{runs}:/work/runs", image, "stat", "-c", "%u %U",
                        "runs/demo/metrics.jsonl", what="the run's owner inside")
    assert inside.stdout.split() == [str(UID), "mpiuser"], inside.stdout


def rendered(tmp_path, config):
    """[ConfigMap, MPIJob] from `python -m mpilearn.jobs --target kubernetes` (one worker of
    two slots, this image)."""
    from mpilearn.cluster import jobs

    site = tmp_path / "site-k8s.yaml"
    site.write_text(yaml.safe_dump({"kubernetes": {
        "image": IMAGE, "workers": 1, "slots_per_worker": 2, "cpus_per_worker": 2,
        "memory": "4Gi", "data_pvc": "mpilearn-data", "runs_pvc": "mpilearn-runs"}}))
    out, cwd = io.StringIO(), os.getcwd()
    os.chdir(tmp_path)  # the config's data/ paths are the data volume's, relative to /work
    try:
        with contextlib.redirect_stdout(out):
            assert jobs.main(["--target", "kubernetes", "--kind", "train", "--config",
                              str(config), "--site", str(site), "--output", "runs/train"]) == 0
    finally:
        os.chdir(cwd)
    return list(yaml.safe_load_all(out.getvalue()))


def mpijob(tmp_path):
    """A rendered MPIJob (one worker of two slots) and what its pods mount: the data volume
    (a toy file), the runs volume, the ConfigMap at /etc/mpilearn, the operator's host file
    at /etc/mpi/hostfile naming the worker; the launcher's environment as the operator sets
    it (OpenMPI)."""
    from mpilearn.data import toy

    data = tmp_path / "data"  # the data volume, filled beforehand
    data.mkdir()
    toy.write_regression(str(data / "toy.h5"))
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({"model": "mpilearn.models.mlp",
                                      "data": {"files": ["data/toy.h5"]},
                                      "train": {"epochs": 1, "batch_size": 32,
                                                "max_steps_per_epoch": 4}}))
    config_map, job = rendered(tmp_path, config)
    name = job["metadata"]["name"]
    specs = {role: job["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]
             for role in ("Launcher", "Worker")}
    for spec in specs.values():
        assert spec["containers"][0]["image"] == IMAGE, spec
        assert spec["securityContext"]["runAsUser"] == UID, spec
    etc = tmp_path / "etc-mpilearn"
    etc.mkdir()
    for key, text in config_map["data"].items():
        (etc / key).write_text(text)
    worker = f"{name}-worker-0.{name}.default.svc"
    (tmp_path / "etc-mpi").mkdir()
    (tmp_path / "etc-mpi" / "hostfile").write_text(f"{worker} slots=2\n")
    runs = world_writable(tmp_path / "runs")
    volumes = [f"{data}:/work/data:ro", f"{runs}:/work/runs", f"{etc}:/etc/mpilearn:ro"]
    env = {"K_MPI_JOB_ROLE": "launcher", "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
           "OMPI_MCA_orte_default_hostfile": "/etc/mpi/hostfile",
           "OMPI_MCA_orte_set_default_slots": "2"}
    return types.SimpleNamespace(
        name=name, worker=worker, runs=runs,
        launcher=specs["Launcher"]["containers"][0], worker_spec=specs["Worker"]["containers"][0],
        volumes=[a for v in volumes for a in ("-v", v)],
        launcher_args=["-v", f"{tmp_path / 'etc-mpi'}:/etc/mpi:ro"]
        + [a for k, v in env.items() for a in ("-e", f"{k}={v}")])


def assert_trained(job, proc):
    assert proc.returncode == 0, (f"launcher exited {proc.returncode}\n--- stdout\n"
                                  f"{_tail(proc.stdout)}\n--- stderr\n{_tail(proc.stderr)}")
    assert f"(MPIJob {job.name}), 2 process(es)" in proc.stdout, proc.stdout
    out = job.runs / "train"
    assert (out / "metrics.jsonl").exists(), _tail(proc.stdout)
    models = list((out / "models").iterdir())
    assert any(p.suffix == ".pt" for p in models), models
    hosts = list(out.glob("hosts-*"))
    assert [h.read_text().split()[0] for h in hosts] == [job.worker], hosts
    assert all(p.stat().st_uid == UID for p in [out, *out.rglob("*")])


def test_the_rendered_mpijob_launcher_command_trains_in_the_image(podman, image, tmp_path):
    """The launcher's command with the host file naming this container (its host name,
    resolving here): Open MPI starts both ranks itself, no ssh."""
    job = mpijob(tmp_path)
    proc = podman.run(NAMES[2], "--hostname", job.worker, "--add-host",
                      f"{job.worker}:127.0.0.1", "-w", job.launcher["workingDir"],
                      *job.volumes, *job.launcher_args, image, *job.launcher["command"],
                      what="the MPIJob launcher's command in the image", check=False)
    assert_trained(job, proc)


def test_the_mpijob_launcher_starts_its_ranks_in_the_worker_container_over_ssh(
        podman, image, tmp_path):
    """Two containers on one podman network, as the operator's pods: the worker runs the
    rendered worker command (sshd on port 2222, as install.sh set it up), the launcher the
    rendered launcher command; the job's key pair at ~/.ssh in both, as the operator's
    Secret is; the volumes shared, as ReadWriteMany ones are."""
    job = mpijob(tmp_path)
    keys = tmp_path / "ssh"
    keys.mkdir()
    subprocess.run(["ssh-keygen", "-q", "-t", "rsa", "-N", "", "-f", str(keys / "id_rsa")],
                   check=True, timeout=60, capture_output=True)
    shutil.copy(keys / "id_rsa.pub", keys / "authorized_keys")
    for f in keys.iterdir():  # root's on the host: readable by UID 1000, as a Secret's files
        f.chmod(0o644)
    if podman("network", "exists", NETWORK, check=False).returncode != 0:
        podman("network", "create", "--subnet", f"{SUBNET}.0/24", NETWORK,
               what=f"podman network create {NETWORK} ({SUBNET}.0/24)")
    hosts = ["--add-host", f"{job.worker}:{SUBNET}.11",
             "--add-host", f"{job.name}-launcher.{job.name}.default.svc:{SUBNET}.10"]
    ssh = ["-v", f"{keys}:/home/mpiuser/.ssh:ro"]
    worker, launcher = NAMES[3], NAMES[2]
    try:
        podman("run", "-d", "--rm", "--name", worker, f"--network={NETWORK}", "--ip",
               f"{SUBNET}.11", "--hostname", job.worker, "--user", str(UID), *hosts, *ssh,
               "-w", job.worker_spec["workingDir"], *job.volumes, image,
               *job.worker_spec["command"], what="the worker container (sshd)")
        deadline = time.monotonic() + 60
        while "Server listening" not in podman("logs", worker, check=False).stderr:
            assert time.monotonic() < deadline, ("the worker's sshd did not start in 60 s:\n"
                                                 + podman("logs", worker, check=False).stderr)
            time.sleep(0.5)
        proc = podman.run(launcher, "--ip", f"{SUBNET}.10", "--hostname",
                          f"{job.name}-launcher", *hosts, *ssh, "-w",
                          job.launcher["workingDir"], *job.volumes, *job.launcher_args, image,
                          *job.launcher["command"], network=NETWORK, check=False,
                          what="the MPIJob launcher's command, ranks over ssh")
        log = podman("logs", worker, check=False)
    finally:
        podman.remove(worker)
    assert_trained(job, proc)
    # the ranks ran in the worker container: its sshd let the launcher's mpirun in
    assert "Accepted publickey for mpiuser" in log.stdout + log.stderr, _tail(log.stderr)
