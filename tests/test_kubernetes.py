"""python -m mpilearn.jobs --target kubernetes: the rendered MPIJob checked against the MPIJob
v2beta1 schema written here from the MPI Operator's API types (tests/data), sized at job start from the operator's host
file, and named in the ranks' launcher line."""
import contextlib
import io
import os

import pytest
import yaml

from conftest import REPO, TESTS, mpirun, train_args
from mpilearn.cluster import allocation, jobs

jsonschema = pytest.importorskip("jsonschema")  # the test extra

SCHEMA = os.path.join(TESTS, "data", "mpijob-v2beta1.schema.yaml")


def strict(schema):
    """kubectl's default (--validate=strict) refuses fields a structural schema does not list:
    the same for jsonschema, so a misspelt field fails here as it would on the cluster."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def validator():
    with open(SCHEMA) as f:
        schema = strict(yaml.safe_load(f))
    return jsonschema.Draft7Validator(schema)


def render(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = jobs.main(["--target", "kubernetes", *argv])
    return rc, out.getvalue(), err.getvalue()


def site_file(tmp_path, **kube):
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump({"kubernetes": kube}))
    return str(path)


CASES = [(kind, impl, gpus) for kind in ("train", "hpo") for impl in ("OpenMPI", "MPICH")
         for gpus in (0, 2)]


@pytest.mark.parametrize("kind,impl,gpus", CASES)
def test_every_rendered_mpijob_validates_against_the_operators_crd(kind, impl, gpus, tmp_path,
                                                                   validator):
    config = os.path.join(REPO, "jobs", "train-3dgan.yaml" if kind == "train" else "hpo-mlp.yaml")
    site = site_file(tmp_path, mpi_implementation=impl, gpus_per_worker=gpus,
                     node_selector={"pool": "gpu"} if gpus else {},
                     tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists",
                                   "effect": "NoSchedule"}] if gpus else [])
    rc, text, err = render("--kind", kind, "--config", config, "--site", site, "--nodes", "2")
    assert rc == 0, err
    config_map, job = list(yaml.safe_load_all(text))
    errors = sorted(validator.iter_errors(job), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)
    spec = job["spec"]
    assert spec["mpiImplementation"] == impl
    assert spec["mpiReplicaSpecs"]["Worker"]["replicas"] == 2
    # a sweep's 4 training ranks (2 blocks x 2 folds) over 2 workers; a run: a rank per GPU
    assert spec["slotsPerWorker"] == 2
    assert spec["runPolicy"]["backoffLimit"] >= 1 and spec["runPolicy"]["cleanPodPolicy"]
    launcher = spec["mpiReplicaSpecs"]["Launcher"]
    assert launcher["restartPolicy"] == "OnFailure"  # a restart resumes
    script = launcher["template"]["spec"]["containers"][0]["command"][2]
    entry = "mpilearn.train" if kind == "train" else "mpilearn.optimize"
    assert f"python -m {entry} " in script and "--resume auto" in script
    assert ("-f \"$HOSTFILE\"" in script) == (impl == "MPICH")
    worker = spec["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    limits = worker["containers"][0]["resources"]["limits"]
    assert limits.get("nvidia.com/gpu") == (gpus or None)
    assert config_map["data"]["config.yaml"] == open(config).read()
    assert config_map["metadata"]["name"] != job["metadata"]["name"] + "-config"  # the operator's


def test_the_schema_check_can_fail(validator):
    """A misspelt field and a wrong type are caught, as kubectl would catch them."""
    rc, text, _ = render("--kind", "train", "--config", os.path.join(REPO, "jobs", "train-3dgan.yaml"))
    job = list(yaml.safe_load_all(text))[1]
    job["spec"]["slotPerWorker"] = 2
    job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] = "two"
    messages = " ".join(e.message for e in validator.iter_errors(job))
    assert "slotPerWorker" in messages and "'two' is not of type 'integer'" in messages


def test_command_line_overrides_the_profile_and_bad_keys_are_named(tmp_path):
    site = site_file(tmp_path, image="old:1", workers=8, gpus_per_worker=4)
    rc, text, err = render("--kind", "train", "--config", os.path.join(REPO, "jobs", "train-3dgan.yaml"),
                           "--site", site, "--nodes", "3", "--gpus-per-node", "1",
                           "--image", "new:2", "--set", "train.epochs=3")
    assert rc == 0, err
    job = list(yaml.safe_load_all(text))[1]
    assert job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == 3
    assert job["spec"]["slotsPerWorker"] == 1
    worker = job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert worker["image"] == "new:2" and worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    launcher = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    assert launcher["command"][-2:] == ["--set", "train.epochs=3"]
    assert "kubectl -n default patch mpijob mpilearn-train" in text  # how to resize
    rc, _, err = render("--kind", "train", "--config", os.path.join(REPO, "jobs", "train-3dgan.yaml"),
                        "--site", site_file(tmp_path, gpus_per_workr=1))
    assert rc == 2 and "unknown config key 'kubernetes.gpus_per_workr'" in err, err
    rc, _, err = render("--kind", "train", "--config", os.path.join(REPO, "jobs", "train-3dgan.yaml"),
                        "--site", site_file(tmp_path, mpi_implementation="LAM"))
    assert rc == 2 and "'kubernetes.mpi_implementation' is 'LAM'" in err, err


def test_plan_sizes_the_job_from_the_operators_host_file(tmp_path):
    hosts = tmp_path / "hostfile"
    hosts.write_text("j-worker-0.j.ns.svc slots=2\nj-worker-1.j.ns.svc slots=2\n")
    env = {"K_MPI_JOB_ROLE": "launcher", "OMPI_MCA_orte_default_hostfile": str(hosts)}
    out = tmp_path / "plan"
    ntasks, _ = allocation.plan("train", {}, "c.yaml", "mpirun", str(out), env)
    assert ntasks == 4 and out.read_text() == hosts.read_text()
    # a sweep: 2 blocks x 2 ranks and the coordinator's extra slot on the first worker
    config = {"search": {"blocks": 2, "folds": 2, "ranks_per_fold": 1, "fold_mode": "parallel"}}
    ntasks, _ = allocation.plan("hpo", config, "c.yaml", "mpirun", str(out), env)
    assert ntasks == 5
    assert out.read_text() == "j-worker-0.j.ns.svc slots=3\nj-worker-1.j.ns.svc slots=2\n"
    # MPICH's Hydra: host:N, resized to 3 workers
    hosts.write_text("".join(f"j-worker-{i}.j.ns.svc:2\n" for i in range(3)))
    env = {"K_MPI_JOB_ROLE": "launcher", "HYDRA_HOST_FILE": str(hosts)}
    assert allocation.plan("train", {}, "c.yaml", "mpirun", str(out), env)[0] == 6
    assert out.read_text() == hosts.read_text()
    with pytest.raises(Exception, match="no host file variable"):
        allocation.plan("train", {}, "c.yaml", "mpirun", str(out), {"K_MPI_JOB_ROLE": "launcher"})


def test_ranks_log_the_mpijob_from_the_role_and_host_file(toy_file, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("cal-worker-0.cal.default.svc slots=1\ncal-worker-1.cal.default.svc slots=1\n")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "model": f"{TESTS}/models/slow64.py", "hparams": {"sleep": 0.0},
        "data": {"files": [toy_file]},
        "train": {"epochs": 1, "batch_size": 16, "max_steps_per_epoch": 1}}))
    proc = mpirun(2, train_args("--config", str(config), "--output", str(tmp_path / "run")),
                  env={"K_MPI_JOB_ROLE": "launcher", "MPILEARN_HOSTFILE": str(hosts)})
    assert proc.returncode == 0, proc.stderr
    assert "launcher mpirun (MPIJob cal), 2 process(es)" in proc.stdout, proc.stdout
