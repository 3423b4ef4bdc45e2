"""python -m mpilearn.jobs: rendered scripts are valid bash, follow the site profile, and the
ready scripts in jobs/ are exactly what the renderer makes (they run in test_slurm.py)."""
import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from mpilearn.cluster import jobs


def render(*args, cwd=REPO):
    """python -m mpilearn.jobs ARGS, in this process (the render-time checks import torch once)."""
    import contextlib
    import io
    import types

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = jobs.main(list(args))
    finally:
        os.chdir(here)
    return types.SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())


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
                 "#SBATCH --signal=B:USR1@300",
                 'srun --mpi=pmix --kill-on-bad-exit=1 --ntasks="$NTASKS"',
                 "then module load $MODULES", "MODULES=${MPILEARN_MODULES-'gcc/12 openmpi/4.1'}",
                 "VENV=${MPILEARN_VENV:-/sw/mpilearn}",
                 'export MPILEARN_STAGE="/tmp/mpilearn-$SLURM_JOB_ID"', "trap unstage EXIT",
                 "--resume auto", "scontrol requeue"):
        assert line in text, line
    assert "module purge" not in text and "--set" not in text  # staging leaves the config alone
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    # one rank per GPU: another tasks_per_node is refused naming both (16 ranks on 32 GPUs,
    # or ranks sharing GPUs, which the run refuses), unless the run allows shared GPUs
    site.write_text(yaml.safe_dump({"gpus_per_node": 4, "tasks_per_node": 8, "modules": ["x"],
                                    "module_purge": True}))
    eight = render("--config", "jobs/train-3dgan.yaml", "--site", str(site))
    assert eight.returncode == 2 and "tasks_per_node 8 with gpus_per_node 4" in eight.stderr
    shared = render("--config", "jobs/train-3dgan.yaml", "--site", str(site),
                    "--set", "device.allow_shared_gpus=true")
    assert "#SBATCH --ntasks-per-node=8" in shared.stdout, shared.stderr
    assert "module purge && module load" in shared.stdout
    cli = render("--config", "jobs/train-3dgan.yaml", "--gpus-per-node", "4", "--tasks-per-node", "2")
    assert cli.returncode == 2 and "tasks_per_node 2 with gpus_per_node 4" in cli.stderr
    assert "2 GPU(s) per node would stay idle" in cli.stderr


def test_sweep_layout_must_fill_the_gpus_and_bad_keys_are_named(tmp_path):
    proc = render("--kind", "hpo", "--config", "jobs/hpo-mlp.yaml", "--nodes", "1",
                  "--gpus-per-node", "2")
    assert proc.returncode == 2 and "4 training ranks" in proc.stderr and "1 node(s) x 2 GPU(s)" in proc.stderr
    ok = render("--kind", "hpo", "--config", "jobs/hpo-mlp.yaml", "--nodes", "2",
                "--gpus-per-node", "2", "--launcher", "mpirun")
    assert ok.returncode == 0, ok.stderr
    # 5 tasks, at most 3 on a node: only the coordinator's node has the extra task
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks=5\n#SBATCH --ntasks-per-node=3\n" in ok.stdout
    assert 'mpirun -np "$NTASKS" --hostfile "$HOSTFILE"' in ok.stdout
    site = tmp_path / "site.yaml"
    site.write_text("gpus_per_nod: 4\n")
    bad = render("--config", "jobs/train-3dgan.yaml", "--site", str(site))
    assert bad.returncode == 2 and "did you mean 'gpus_per_node'" in bad.stderr


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(os.path.join(REPO, "jobs"))
                                        if n.startswith("hpo-") and n.endswith(".yaml")))
def test_example_sweep_configs_are_valid(name):
    """The example sweeps resolve, and their objective, searcher, pruner and space are accepted
    (what rank 0 checks before any trial, short of reading data)."""
    from mpilearn.core.config import hpo_schema, resolve
    from mpilearn.hpo import objective
    from mpilearn.hpo.pruners import make_pruner
    from mpilearn.hpo.searchers import make_searcher
    from mpilearn.hpo.space import Space
    from mpilearn.core.builders import default_hparams

    config = resolve(os.path.join(REPO, "jobs", name), schema=hpo_schema(), require_model=False)
    s = config["search"]
    obj = objective.parse(config)
    declared = default_hparams(config["model"])
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


def alloc(slots, gpus=0):
    return {"ntasks": sum(slots), "hosts": [f"n{i}" for i in range(len(slots))],
            "slots": slots, "gpus": gpus}


def test_a_sweep_is_placed_on_the_allocation_it_gets_or_refused_naming_both():
    from mpilearn.cluster.allocation import place_sweep

    # the coordinator first, on node 0; then the training ranks in node order
    assert place_sweep(alloc([5]), 2, 2, "s.yaml") == [5]
    assert place_sweep(alloc([9]), 2, 2, "s.yaml") == [5]          # room to spare: 5 of 9
    assert place_sweep(alloc([3, 3]), 2, 2, "s.yaml") == [3, 2]
    assert place_sweep(alloc([3, 3], gpus=2), 2, 2, "s.yaml") == [3, 2]
    with pytest.raises(Exception) as err:
        place_sweep(alloc([3]), 2, 2, "s.yaml")
    message = str(err.value)
    assert "s.yaml needs 5 task(s) (1 coordinator + 2 block(s) x 2 rank(s) per trial)" in message
    assert "the allocation has 3 task(s) on 1 node(s)" in message
    assert "sbatch --ntasks=5" in message and "--set search.blocks=1" in message
    with pytest.raises(Exception, match="one GPU each"):  # 4 slots but one GPU per node
        place_sweep(alloc([4, 4], gpus=1), 2, 2, "s.yaml")


def test_the_coordinator_goes_to_the_node_that_holds_the_extra_task():
    """The sweep header (--ntasks=5, at most 3 per node) may come back as 2,3: the coordinator
    and the host file's first line go to the node with 3, and the GPUs fill exactly."""
    from mpilearn.cluster.allocation import coordinator_first, place_sweep

    given = coordinator_first(alloc([2, 3], gpus=2))
    assert given["hosts"] == ["n1", "n0"] and given["slots"] == [3, 2]
    assert place_sweep(given, 2, 2, "s.yaml") == [3, 2]
    assert coordinator_first(alloc([3, 3, 2]))["hosts"] == ["n0", "n1", "n2"]  # stable


def test_plan_outside_an_allocation_is_bad_input():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run([sys.executable, "-m", "mpilearn.jobs", "--plan", "--kind", "hpo",
                           "--config", "jobs/hpo-mlp.yaml", "--set", "search.blocks=1"],
                          capture_output=True, text=True, cwd=REPO, env=env)
    assert proc.returncode == 2 and "not inside a SLURM allocation" in proc.stderr, proc.stderr


def test_staging_keeps_same_named_files_apart_and_the_reader_opens_the_copies(tmp_path, monkeypatch):
    from mpilearn.data.hdf5 import EventFiles
    from mpilearn.cluster.stage import ENV, local, stage
    from mpilearn.data.toy import write_regression

    sources = [write_regression(str(tmp_path / d / "part.h5"), events=n, seed=n)
               for d, n in (("a", 10), ("b", 20))]
    stage_dir = str(tmp_path / "stage")
    assert stage(sources, stage_dir) == (2, sum(os.path.getsize(p) for p in sources))
    assert stage(sources, stage_dir)[0] == 0  # a second call on the node: present already
    monkeypatch.setenv(ENV, stage_dir)
    copies = [local(p) for p in sources]
    assert len(set(copies)) == 2 and all(c.startswith(stage_dir) for c in copies)
    files = EventFiles(sources, ["X", "y"])
    assert files.paths == sources and list(files.counts) == [10, 20]  # sources, as recorded
    files.read([0, 15])
    assert [files._file(i).filename for i in (0, 1)] == copies
    monkeypatch.setenv(ENV, str(tmp_path / "elsewhere"))  # not staged here: the source
    assert local(sources[0]) == sources[0]


@pytest.mark.parametrize("launcher_ends", ["during the trap", "after the trap"])
def test_the_scripts_read_the_launchers_own_status_after_a_trapped_signal(launcher_ends):
    """A signal to the batch shell interrupts `wait` (143) and is passed on; the launcher
    then saves its state and exits 75. Whether it ends while the trap runs (the race CI met:
    the job read 143, was not requeued) or after, the script must read 75."""
    from mpilearn.cluster.shell import WAIT_FOR_LAUNCHER

    pause = "sleep 0.5" if launcher_ends == "during the trap" else ":"
    script = "\n".join([
        "( trap 'exit 75' USR1; sleep 10 & wait ) &",
        "pid=$!",
        f"trap 'kill -USR1 $pid; {pause}' TERM",
        "( sleep 0.3; kill -TERM $$ ) &",
        *WAIT_FOR_LAUNCHER,
        'echo "rc=$rc"'])
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "rc=75", out


def test_the_example_site_profile_puts_one_rank_on_each_gpu():
    """jobs/site-example.yaml with its commented GPU line switched on: 4 ranks per node on 4
    GPUs, not the 2 its tasks_per_node once kept (16 ranks on 32 GPUs)."""
    text = open(os.path.join(REPO, "jobs", "site-example.yaml")).read()
    assert "\ntasks_per_node: 0" in text
    site = yaml.safe_load(text)
    site["gpus_per_node"] = 4
    assert jobs.layout("train", {}, jobs.load_site(None, site))["per_node"] == 4


@pytest.mark.parametrize("target", ["slurm", "kubernetes"])
def test_render_refuses_what_the_job_would_refuse(target, tmp_path):
    """The model, its hyperparameters and the slots against the GPUs are checked as train
    checks them, before a job is rendered: exit 2 naming the key or both values."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": "models/mlp.py", "data": {"files": ["data/toy.h5"]},
                                      "train": {"epochs": 1}}))
    base = ("--target", target, "--config", str(config), "--image", "r/m:1")
    typo = render(*base, "--set", "hparams.hiden=3")
    assert typo.returncode == 2 and "hparams.hiden" in typo.stderr
    assert "did you mean 'hidden'" in typo.stderr
    slots = render(*base, "--tasks-per-node", "8", "--gpus-per-node", "4")
    assert slots.returncode == 2 and "8 with" in slots.stderr and "4: mpilearn runs one rank per GPU" in slots.stderr
    missing = render(*base, "--set", "model=models/nope.py")
    assert missing.returncode == 2 and "model file not found: models/nope.py" in missing.stderr
    cuda = render(*base, "--set", "device.type=cuda")
    assert cuda.returncode == 2 and "device.type is cuda but the job asks for no GPU" in cuda.stderr
    space = render("--target", target, "--kind", "hpo", "--config", "jobs/hpo-mlp.yaml",
                   "--image", "r/m:1", "--set", "search.space.hiden={type: int, low: 1, high: 4}")
    assert space.returncode == 2 and "hiden" in space.stderr, space.stderr
    ok = render(*base)
    assert ok.returncode == 0, ok.stderr


def test_the_price_is_per_device_kind_with_a_currency(tmp_path):
    from mpilearn.cluster import price

    site = tmp_path / "site.yaml"
    site.write_text("price: {gpu_hour: 2.5, cpu_hour: 0.05, currency: USD}\n")
    p = jobs.load_site(str(site), {})["price"]
    assert p == {"gpu_hour": 2.5, "cpu_hour": 0.05, "currency": "USD"}
    assert price.per_hour(p, "gpu") == 2.5 and price.per_hour(p, "cpu") == 0.05
    assert price.describe(p, "cpu") == "0.05 USD per CPU-rank-hour"
    for text, message in [("price: {gpu_hour: 2.5}", "'price.currency' is missing"),
                          ("price: {gpu_hours: 2.5, currency: USD}", "did you mean 'price.gpu_hour'"),
                          ("price: {cpu_hour: -1, currency: USD}", "'price.cpu_hour' must be 0 or more"),
                          ("price: {gpu_hour: 1, currency: US D}", "'price.currency' is 'US D'"),
                          ("price: cheap", "'price' must be a mapping")]:
        site.write_text(text + "\n")
        with pytest.raises(Exception, match=".*") as err:
            jobs.load_site(str(site), {})
        assert message in str(err.value) and str(site) in str(err.value), (text, err.value)
    # the old form: one number, read as GPU-hours only (a CPU rank never pays a GPU's rate)
    site.write_text("price: 3.0\n")
    proc = subprocess.run([sys.executable, "-c", "from mpilearn.cluster.jobs import load_site; "
                           f"print(load_site({str(site)!r}, {{}})['price'])"],
                          capture_output=True, text=True, cwd=REPO)
    assert "{'gpu_hour': 3.0, 'cpu_hour': 0.0, 'currency': ''}" in proc.stdout, proc.stderr
    assert "'price: 3' (one number for every device-hour) is deprecated" in proc.stderr


def test_an_elastic_training_renders_ulfm_where_mpirun_has_it_and_says_what_srun_does():
    site = os.path.join(REPO, "jobs", "site-example.yaml")
    base = ("--kind", "train", "--config", "jobs/train-3dgan.yaml", "--site", site)
    elastic = ("--set", "train.elastic.min_ranks=2")

    def launch(text):
        (line,) = [l for l in text.splitlines() if "python -m mpilearn.train" in l]
        return line

    plain = render(*base, "--launcher", "mpirun")
    assert plain.returncode == 0 and "--with-ft" not in plain.stdout
    made = render(*base, "--launcher", "mpirun", *elastic)
    assert made.returncode == 0, made.stderr
    # the run gets the config that was rendered: the render-time --set is in its command
    assert "--with-ft ulfm python -m mpilearn.train" in launch(made.stdout)
    assert "--set train.elastic.min_ranks=2 \"$@\"" in launch(made.stdout)
    srun = render(*base, "--launcher", "srun", *elastic)
    assert "--with-ft" not in srun.stdout and "srun has no ULFM" in srun.stdout
    kube = render(*base, "--target", "kubernetes", "--image", "img:1", *elastic)
    assert kube.returncode == 0 and "--bind-to none --with-ft ulfm" in kube.stdout, kube.stderr
    for text in (made.stdout, srun.stdout):
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
