"""What a user gets from `pip install mpilearn[mpi-wheel]` (torch pinned) into a fresh venv:
the wheel holds every package, the example models, py.typed and the jobs templates, and its
dependencies alone run the demo job from a directory outside the checkout.

The venv sees nothing of the development venv (no .pth, no PYTHONPATH, its own mpirun). Its
packages come from a wheelhouse in the mpilearn cache, filled by `pip download` the first time
(or when a dependency changes), so later runs install offline."""
import glob
import os
import subprocess
import sys
import zipfile

import pytest

from conftest import ENV, REPO, shared

CACHE = os.path.join(os.environ.get("MPILEARN_CACHE") or os.path.expanduser("~/.cache/mpilearn"),
                     "wheelhouse")
TORCH = "torch==2.13.0"  # the CPU build: pip's find-links here hold torch-2.13.0+cpu


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> str:
    """The project's wheel, built once per session (a build writes in the checkout's build/,
    so two at once would collide) and shared read-only."""
    def build(wheels):
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", str(wheels), REPO],
                       check=True, capture_output=True, timeout=300)

    (path,) = glob.glob(str(shared(tmp_path_factory, "wheel", build) / "mpilearn-*.whl"))
    return path


def test_the_wheel_holds_packages_models_and_the_jobs_templates(wheel):
    z = zipfile.ZipFile(wheel)
    names = set(z.namelist())
    packages = {os.path.relpath(os.path.join(d, "__init__.py"), REPO)
                for d, _, files in os.walk(os.path.join(REPO, "mpilearn")) if "__init__.py" in files}
    assert packages <= names, packages - names  # every package of the source tree
    assert {"mpilearn/py.typed", "mpilearn/models/gan3d.py", "mpilearn/models/mlp.py"} <= names
    # the templates are jobs/ itself, copied at build time: they cannot drift
    jobs = sorted(n for n in os.listdir(os.path.join(REPO, "jobs"))
                  if n.endswith((".yaml", ".sbatch", ".sh")))
    shipped = sorted(os.path.basename(n) for n in names if n.startswith("mpilearn/jobs_data/"))
    assert shipped == jobs
    for name in jobs:
        with open(os.path.join(REPO, "jobs", name), "rb") as f:
            assert z.read(f"mpilearn/jobs_data/{name}") == f.read(), name
    meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    core = [l.split(":", 1)[1].strip() for l in meta.splitlines()
            if l.startswith("Requires-Dist:") and "extra ==" not in l]
    assert any(r.startswith("scipy") for r in core), core  # the demo's simulation imports it


def clean_env(venv: str) -> dict:
    """No PYTHONPATH (the checkout's mpilearn.egg-info would count as installed), no
    development venv on PATH."""
    env = {k: v for k, v in ENV.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([os.path.join(venv, "bin"), "/usr/local/bin", "/usr/bin", "/bin"])
    return env


def fresh_venv(tmp_path, wheel) -> str:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index",
           "--find-links", CACHE, TORCH, f"{wheel}[mpi-wheel]"]
    env = clean_env(str(venv))
    proc = subprocess.run(pip, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:  # first run, or a new dependency: fill the wheelhouse once
        os.makedirs(CACHE, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", CACHE, TORCH,
                        f"{wheel}[mpi-wheel]"], check=True, capture_output=True, timeout=1200)
        for stale in glob.glob(os.path.join(CACHE, "mpilearn-*")):
            os.unlink(stale)  # the project's own wheel is always the one just built
        proc = subprocess.run(pip, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(venv)


def test_a_fresh_venv_with_the_wheel_runs_the_demo_job_and_finds_the_templates(tmp_path, wheel):
    venv = fresh_venv(tmp_path, wheel)
    bin_ = os.path.join(venv, "bin")
    python = os.path.join(bin_, "python")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = clean_env(venv)

    def run(*cmd, timeout=300):
        return subprocess.run(list(cmd), cwd=elsewhere, env=env, capture_output=True, text=True,
                              timeout=timeout)

    where = run(python, "-c", "import sys, mpilearn, torch, mpi4py.MPI; "
                "print(mpilearn.__file__, torch.__version__); print(sys.path)")
    assert where.returncode == 0, where.stderr
    first, path = where.stdout.splitlines()
    assert first.startswith(venv) and first.endswith("+cpu"), first  # the wheel's copy; CPU torch
    dev = os.path.dirname(os.path.dirname(sys.executable))
    assert dev not in path and REPO not in path, path  # nothing of the development venv

    copied = run(python, "-m", "mpilearn.jobs", "--templates", "jobs")
    assert copied.returncode == 0 and "jobs_data" in copied.stdout, copied.stdout + copied.stderr
    rendered = run(python, "-m", "mpilearn.jobs", "--config", "jobs/train-3dgan.yaml",
                   "--site", "jobs/site-example.yaml")
    assert rendered.returncode == 0, rendered.stderr
    assert rendered.stdout == (elsewhere / "jobs" / "train.sbatch").read_text()

    job = run(os.path.join(bin_, "mpirun"), "-np", "2", "--oversubscribe", python, "-m",
              "mpilearn.train", "--no-progress", "--demo", "--output", "run", "--set",
              "train.epochs=1", "--set", "train.max_steps_per_epoch=2", "--set",
              "train.physics_events=32", timeout=600)
    assert job.returncode == 0, job.stdout + job.stderr
    assert (elsewhere / "run" / "models" / "generator.safetensors").exists()
    assert "mpilearn.models.gan3d" in (elsewhere / "run" / "config.yaml").read_text()
