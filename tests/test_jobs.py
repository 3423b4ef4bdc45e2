"""python -m mpilearn.jobs: rendered scripts are valid bash, follow the site profile, and the
ready scripts in jobs/ are exactly what the renderer makes (they run in test_slurm.py)."""
import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from mpilearn import jobs


def render(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "mpilearn.jobs", *args], capture_output=True,
                          text=True, cwd=cwd)


def test_ready_scripts_are_the_renderers_output():
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        made = jobs.examples("jobs")
    finally:
        os.chdir(cwd)
    for name, text in made.items():
        with open(os.path.join(REPO, "jobs", name)) as f:
            assert f.read() == text, f"jobs/{name} is stale: run `make jobs`"
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0, name


def test_gpu_site_profile(tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({
        "partition": "gpu", "account": "calo", "modules": ["gcc/12", "openmpi/4.1"],
        "venv": "/sw/mpilearn", "gpus_per_node": 4, "stage_to": "/tmp", "launcher": "srun"}))
    proc = render("--kind", "train", "--config", "jobs/train-3dgan.yaml", "--site", str(site),
                  "--nodes", "8", "--time", "12:00:00")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for line in ("#SBATCH --nodes=8", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --partition=gpu", "#SBATCH --account=calo", "#SBATCH --time=12:00:00",
                 "#SBATCH --signal=B:USR1@300", "srun --mpi=pmix --kill-on-bad-exit=1 --ntasks=32",
                 "module load $MODULES", "MODULES=${MPILEARN_MODULES-'gcc/12 openmpi/4.1'}",
                 "VENV=${MPILEARN_VENV:-/sw/mpilearn}", 'STAGE="/tmp/mpilearn-$SLURM_JOB_ID"',
                 "--resume auto", "scontrol requeue"):
        assert line in text, line
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_sweep_layout_must_fill_the_gpus_and_bad_keys_are_named(tmp_path):
    proc = render("--kind", "hpo", "--config", "jobs/hpo-mlp.yaml", "--nodes", "1",
                  "--gpus-per-node", "2")
    assert proc.returncode == 2 and "4 training ranks" in proc.stderr and "1 node(s) x 2 GPU(s)" in proc.stderr
    ok = render("--kind", "hpo", "--config", "jobs/hpo-mlp.yaml", "--nodes", "2",
                "--gpus-per-node", "2", "--launcher", "mpirun")
    assert ok.returncode == 0, ok.stderr
    assert "COUNTS=(3 2)" in ok.stdout and "mpirun -np 5 --hostfile" in ok.stdout
    site = tmp_path / "site.yaml"
    site.write_text("gpus_per_nod: 4\n")
    bad = render("--config", "jobs/train-3dgan.yaml", "--site", str(site))
    assert bad.returncode == 2 and "did you mean 'gpus_per_node'" in bad.stderr


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(os.path.join(REPO, "jobs"))
                                        if n.startswith("hpo-") and n.endswith(".yaml")))
def test_example_sweep_configs_are_valid(name):
    """The example sweeps resolve, and their objective, searcher, pruner and space are accepted
    (what rank 0 checks before any trial, short of reading data)."""
    from mpilearn.config import hpo_schema, resolve
    from mpilearn.hpo import objective
    from mpilearn.hpo.pruners import make_pruner
    from mpilearn.hpo.searchers import make_searcher
    from mpilearn.hpo.space import Space
    from mpilearn.builders import default_hparams

    config = resolve(os.path.join(REPO, "jobs", name), schema=hpo_schema(), require_model=False)
    s = config["search"]
    obj = objective.parse(config)
    declared = default_hparams(os.path.join(REPO, config["model"]))
    space = Space.from_config(s["space"], {**declared, **config["hparams"]}, known=set(declared))
    make_searcher(s["searcher"], space, s["seed"], len(obj["directions"]), **s["options"])
    make_pruner(s["pruner"], obj["directions"][0], **s["pruner_options"])
    assert set(config["hparams"]) <= set(declared)


def test_rendered_scripts_give_ranks_cores_over_ranks_unless_cpus_per_task():
    text = open(os.path.join(REPO, "jobs", "train.sbatch")).read()
    (line,) = [l for l in text.splitlines() if "OMP_NUM_THREADS" in l and not l.startswith("#")]

    def threads(**env):
        return subprocess.run(["bash", "-c", f"set -u; {line}; echo ${{OMP_NUM_THREADS:-unset}}"],
                              env={"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1", **env},
                              capture_output=True, text=True, check=True).stdout.strip()

    assert threads(SLURM_CPUS_PER_TASK="4") == "4"
    assert threads() == "unset"  # mpilearn then gives each rank cores / ranks on the node
