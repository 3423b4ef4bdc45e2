"""containers/install.sh, the one install recipe of the OCI image (containers/Containerfile)
and the Apptainer image (containers/mpilearn.def). OCI runtimes do not run on this machine
(podman stops on "cgroups in hybrid mode not supported"), so the script is tested on its own,
in a fresh directory and virtual environment, and `make demo` runs with what it built."""
import os
import shutil
import site
import subprocess
import sys

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
