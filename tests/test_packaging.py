"""What `pip install .` gives: a wheel with every package, the example models and py.typed,
that runs the default job from a directory outside the checkout."""
import glob
import os
import subprocess
import sys
import sysconfig
import zipfile

from conftest import ENV, REPO


def test_the_wheel_runs_the_default_job_outside_the_checkout(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), REPO],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = glob.glob(str(wheels / "mpilearn-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {os.path.relpath(os.path.join(d, "__init__.py"), REPO)
                for d, _, files in os.walk(os.path.join(REPO, "mpilearn")) if "__init__.py" in files}
    assert packages <= names, packages - names  # every package of the source tree
    assert {"mpilearn/py.typed", "mpilearn/models/gan3d.py", "mpilearn/models/mlp.py"} <= names

    # a fresh venv: the wheel inside it, the dependencies seen through a .pth (no network)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel],
                   check=True, capture_output=True, timeout=300)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
    where = subprocess.run([python, "-c", "import mpilearn.models.gan3d as m; print(m.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert where.stdout.startswith(str(venv)), where.stdout  # the wheel's copy, not the checkout
    job = subprocess.run(["mpirun", "-np", "2", "--oversubscribe", python, "-m", "mpilearn.train",
                          "--no-progress", "--demo", "--output", "run", "--set", "train.epochs=1",
                          "--set", "train.max_steps_per_epoch=2", "--set", "train.physics_events=32"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stderr
    assert (elsewhere / "run" / "models" / "generator.safetensors").exists()
    assert "mpilearn.models.gan3d" in (elsewhere / "run" / "config.yaml").read_text()
