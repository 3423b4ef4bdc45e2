"""containers/install.sh, the one install recipe of the OCI image (containers/Containerfile)
and the Apptainer image (containers/mpilearn.def). OCI runtimes do not run on this machine
(podman stops on "cgroups in hybrid mode not supported"), so the script is tested on its own,
in a fresh directory and virtual environment, and `make demo` runs with what it built. The
build contexts are read from the docker client itself (against a stand-in engine), and the
image's user from install.sh run on copies of the bases' /etc files."""
import os
import shutil
import site
import subprocess
import sys

import pytest

from conftest import ENV, REPO

SCRIPT = os.path.join(REPO, "containers", "install.sh")


def test_install_script_builds_an_environment_that_runs_make_demo(tmp_path):
    prefix = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", str(prefix)], check=True)
    # torch, TensorFlow and mpi4py are seen from the shared venv (a .pth file, as the Makefile's
    # MPICH venv does) instead of downloaded again: the script's pinned torch and its extras
    # are then satisfied, and mpilearn itself is installed into the fresh venv from the checkout
    fresh_site = subprocess.run([str(prefix / "bin" / "python"), "-c",
                                 "import site; print(site.getsitepackages()[0])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(fresh_site, "shared-venv.pth"), "w") as f:
        f.write(site.getsitepackages()[0] + "\n")
    # the shared venv's Open MPI plays the site's MPI: mpicc and mpirun on PATH, libmpi on
    # the loader's path
    shared = os.path.dirname(os.path.dirname(sys.executable))
    env = {**ENV, "PATH": f"{shared}/bin:{ENV['PATH']}", "LD_LIBRARY_PATH": f"{shared}/lib"}
    # a fresh copy of the source, as an image build has (pip builds in it: build/, egg-info)
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "runs", "build", "*.egg-info", "__pycache__", ".*cache", ".bench-deps"))
    proc = subprocess.run(["bash", str(src / "containers" / "install.sh"), "venv", str(prefix),
                           str(src)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "install.sh: mpilearn" in proc.stdout and "Open MPI" in proc.stdout, proc.stdout
    where = subprocess.run([str(prefix / "bin" / "python"), "-c",
                            "import mpilearn.cluster.jobs as j; print(j.templates_dir())"],
                           cwd=tmp_path, capture_output=True, text=True, env=env)
    # a standalone install (the wheel's jobs_data), not the shared venv's editable checkout
    assert where.stdout.strip() == os.path.join(fresh_site, "mpilearn", "jobs_data"), where
    (prefix / ".installed").touch()  # `make demo` would otherwise set up its own .venv
    quick = "--set train.epochs=1 --set train.max_steps_per_epoch=1 --set train.validate_every=0"
    demo = subprocess.run(["make", "-f", os.path.join(REPO, "Makefile"), "-o",
                           str(prefix / ".installed"), "demo", f"VENV={prefix}", "NP=2",
                           f"DEMO_ARGS={quick}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert (tmp_path / "runs" / "demo" / "metrics.jsonl").exists()


def test_install_script_configures_sshd_for_mpijob_workers(tmp_path):
    proc = subprocess.run(["bash", SCRIPT, "sshd", str(tmp_path / "etc"), str(tmp_path / "home"),
                           "2222"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    server = (tmp_path / "home" / ".sshd_config").read_text().splitlines()
    assert "Port 2222" in server and f"HostKey {tmp_path}/home/.ssh/id_rsa" in server
    assert "StrictModes no" in server
    client = (tmp_path / "etc" / "ssh_config").read_text()
    assert "StrictHostKeyChecking no" in client and "Port 2222" in client
    # sshd itself accepts the configuration (-t: test mode) once the key exists
    subprocess.run(["ssh-keygen", "-q", "-t", "rsa", "-N", "", "-f",
                    str(tmp_path / "home" / ".ssh" / "id_rsa")], check=True)
    check = subprocess.run(["/usr/sbin/sshd", "-t", "-f", str(tmp_path / "home" / ".sshd_config")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    bad = subprocess.run(["bash", SCRIPT, "sshd", str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage: install.sh sshd ETC HOME PORT" in bad.stderr


# -- the build contexts: what each documented build copies into the image ---------------------

ALLOWED = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "mpilearn", "jobs", "models",
           "containers")
# what a used checkout holds besides its tracked files (make demo's .venv, runs, data, caches)
JUNK = (".venv/lib/python3/site-packages/torch/big.so", "runs/demo/metrics.jsonl",
        "data/toy.h5", ".git/HEAD", "mpilearn/__pycache__/errors.cpython-311.pyc",
        "mpilearn/core/__pycache__/config.cpython-311.pyc", ".pytest_cache/v/x",
        "build/lib/mpilearn/__init__.py", "mpilearn.egg-info/PKG-INFO", ".cache/pip/x",
        "tests/test_x.py", "bench/RESULTS.md")


def used_checkout(tmp_path):
    """A copy of the tracked files plus what `make demo` and the tests leave behind."""
    root = tmp_path / "checkout"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                             check=True).stdout.decode().split("\0")
    for name in filter(None, tracked):
        if os.path.islink(os.path.join(REPO, name)):  # models -> mpilearn/models
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(os.path.join(REPO, name)), root / name)
        elif os.path.isfile(os.path.join(REPO, name)):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.join(REPO, name), root / name)
    for name in JUNK:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("junk")
    return root


def docker_context(root, dockerfile):
    """The file names the docker client sends as the build context, read from the client
    itself (its own .dockerignore matcher): a stand-in engine on a unix socket keeps the
    context's tar and refuses the build (no engine runs on this machine)."""
    import http.server
    import socketserver
    import tarfile
    import threading

    got = {}

    class Engine(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _reply(self, code, body):
            self.send_response(code)
            self.send_header("Api-Version", "1.41")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # /_ping
            self._reply(200, b"OK")

        def do_HEAD(self):
            self._reply(200, b"")

        def do_POST(self):  # /build: the context as a (chunked) tar
            data = b""
            if self.headers.get("Transfer-Encoding") == "chunked":
                while (n := int(self.rfile.readline().strip(), 16)):
                    data += self.rfile.read(n)
                    self.rfile.readline()
                self.rfile.readline()
            else:
                data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            got["tar"] = data
            self._reply(500, b'{"message": "context captured"}')

        def log_message(self, *args):
            pass

    class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True

    sock = str(root.parent / "engine.sock")
    server = Server(sock, Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        proc = subprocess.run(["docker", "build", "-f", dockerfile, "."], cwd=root,
                              env={**os.environ, "DOCKER_HOST": f"unix://{sock}",
                                   "DOCKER_BUILDKIT": "0", "DOCKER_CONFIG": str(root.parent)},
                              capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
        server.server_close()
    assert "tar" in got, proc.stdout + proc.stderr
    import io

    with tarfile.open(fileobj=io.BytesIO(got["tar"])) as tar:
        return {m.name.rstrip("/") for m in tar.getmembers() if not m.isdir()}


def apptainer_files(def_path):
    """(source, destination) of the .def's %files section."""
    section, out = None, []
    for line in open(def_path):
        if line.startswith("%"):
            section = line.split()[0]
        elif section == "%files" and line.strip() and not line.lstrip().startswith("#"):
            out.append(tuple(line.split()))
    return out


def assert_image_files(names, where):
    for need in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "mpilearn/__init__.py",
                 "mpilearn/cluster/jobs.py", "jobs/site-example.yaml", "mpilearn/models/mlp.py",
                 "models", "containers/install.sh"):  # models: the link to mpilearn/models
        assert need in names, f"{where}: {need} is missing"
    for name in names:
        top = name.split("/")[0]
        assert top in ALLOWED, f"{where}: {name} would be copied into the image"
        assert "__pycache__" not in name and ".egg-info" not in name, f"{where}: {name}"


def test_every_build_context_holds_the_package_and_none_of_the_checkouts_junk(tmp_path):
    """docker/podman build (the Containerfile, CPU and CUDA variants alike: --build-arg does not
    change the context) and apptainer build (the .def's named %files)."""
    if shutil.which("docker") is None:
        pytest.fail("the docker client is needed (this machine kind has it; no engine is used)")
    root = used_checkout(tmp_path)
    # the client always sends .dockerignore (the engine drops it when the rules exclude it)
    names = docker_context(root, "containers/Containerfile") - {".dockerignore"}
    assert_image_files(names, "docker build")
    # Podman and Buildah read .containerignore first: the same rules
    assert (root / ".containerignore").read_text() == (root / ".dockerignore").read_text()
    # Apptainer: only named paths, the same allow-list; each expands like the docker context
    files = apptainer_files(os.path.join(REPO, "containers", "mpilearn.def"))
    assert sorted(src for src, _ in files) == sorted(ALLOWED)
    assert all(dst == f"/src/mpilearn/{src}" for src, dst in files), files
    copied = set()
    for src, _ in files:
        path = root / src
        # (Apptainer copies with cp -L: models, the link, arrives as the folder it names)
        copied |= ({str(p.relative_to(root)) for p in path.rglob("*") if p.is_file()}
                   if path.is_dir() and not path.is_symlink() else {src})
    # %post removes the caches inside them (a SIF has no layers)
    post = open(os.path.join(REPO, "containers", "mpilearn.def")).read()
    assert "-name __pycache__ -o -name '*.egg-info'" in post
    kept = {n for n in copied if "__pycache__" not in n and ".egg-info" not in n}
    assert_image_files(kept, "apptainer build")
    assert kept == names, kept ^ names  # both images get the same files


@pytest.mark.parametrize("base", ["ubuntu:24.04", "debian:bookworm-slim"])
def test_the_image_user_is_uid_1000_whether_or_not_the_base_has_one(base, tmp_path):
    """ubuntu:24.04 (and nvidia/cuda:*-ubuntu24.04) ship user 'ubuntu' with UID 1000, where
    useradd -u 1000 fails: install.sh user renames it; on debian it makes the user. Run on
    copies of those bases' /etc files (useradd --prefix), as the Containerfile's RUN does."""
    etc = tmp_path / "etc"
    etc.mkdir()
    users = ["root:x:0:0:root:/root:/bin/bash"]
    groups = ["root:x:0:", "users:x:100:"]
    if base.startswith("ubuntu"):
        users.append("ubuntu:x:1000:1000:Ubuntu:/home/ubuntu:/bin/bash")
        groups.append("ubuntu:x:1000:")
        (tmp_path / "home" / "ubuntu").mkdir(parents=True)
        (tmp_path / "home" / "ubuntu" / ".bashrc").write_text("# ubuntu's\n")
    (etc / "passwd").write_text("\n".join(users) + "\n")
    (etc / "group").write_text("\n".join(groups) + "\n")
    (etc / "shadow").write_text("".join(f"{u.split(':')[0]}:*:19000:0:99999:7:::\n" for u in users))
    (etc / "gshadow").write_text("".join(f"{g.split(':')[0]}:*::\n" for g in groups))
    proc = subprocess.run(["bash", SCRIPT, "user", "mpiuser", "1000", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    passwd = [line.split(":") for line in (etc / "passwd").read_text().splitlines()]
    (me,) = [u for u in passwd if u[2] == "1000"]
    assert me[0] == "mpiuser" and me[3] == "1000" and me[5] == "/home/mpiuser", me
    assert "mpiuser:x:1000:" in (etc / "group").read_text().splitlines()
    assert (tmp_path / "home" / "mpiuser").is_dir()
    if base.startswith("ubuntu"):
        assert "renamed to 'mpiuser'" in proc.stdout
        assert (tmp_path / "home" / "mpiuser" / ".bashrc").exists()  # the home moved with it
        assert not (tmp_path / "home" / "ubuntu").exists()
    again = subprocess.run(["bash", SCRIPT, "user", "mpiuser", "1000", str(tmp_path)],
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stderr  # a rebuild on a base that has it already
