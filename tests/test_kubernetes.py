"""python -m mpilearn.jobs --target kubernetes: the rendered MPIJob checked against the MPI
Operator's CRD schema (an excerpt derived from its kubeflow.org_mpijobs.yaml: tests/data), with
every field the site profile can set, sized at job start from the operator's host file, and
named in the ranks' launcher line."""
import contextlib
import io
import os

import pytest
import yaml

from conftest import REPO, TESTS, mpirun, train_args
from mpilearn.cluster import allocation, jobs

jsonschema = pytest.importorskip("jsonschema")  # the test extra

SCHEMA = os.path.join(TESTS, "data", "mpijob-v2beta1.crd-excerpt.yaml")


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
    assert launcher["restartPolicy"] == "ExitCode"  # 1-127 permanent, 128+ retried (resumes)
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


def errors_of(validator, job):
    errors = sorted(validator.iter_errors(job), key=lambda e: list(e.path))
    return "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


TRAIN = os.path.join(REPO, "jobs", "train-3dgan.yaml")


def test_every_profile_field_renders_where_the_crd_has_it(tmp_path, validator):
    site = site_file(
        tmp_path, image="r.example.org/me/mpilearn:1", gpus_per_worker=2, memory="64Gi",
        shm_size="16Gi", image_pull_secrets=["regcred"], service_account="trainer",
        priority_class="high", launcher_node_selector={"pool": "cpu"},
        launcher_tolerations=[{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
        gang=True, scheduling_policy={"queue": "research", "scheduleTimeoutSeconds": 600},
        deadline="2-00:00:00", ttl_after_finished=3600, queue="team-a", suspend=True,
        runs_chown=True, extra_pod_spec={"runtimeClassName": "nvidia", "hostIPC": False})
    rc, text, err = render("--kind", "train", "--config", TRAIN, "--site", site, "--nodes", "3")
    assert rc == 0, err
    job = list(yaml.safe_load_all(text))[1]
    assert not errors_of(validator, job), errors_of(validator, job)
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    policy = job["spec"]["runPolicy"]
    assert policy["activeDeadlineSeconds"] == 2 * 86400 and policy["ttlSecondsAfterFinished"] == 3600
    assert policy["suspend"] is True
    assert policy["schedulingPolicy"] == {"queue": "research", "scheduleTimeoutSeconds": 600,
                                          "minAvailable": 4}  # 3 workers + the launcher
    specs = job["spec"]["mpiReplicaSpecs"]
    launcher, worker = (specs[r]["template"]["spec"] for r in ("Launcher", "Worker"))
    for pod in (launcher, worker):
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
        assert pod["serviceAccountName"] == "trainer" and pod["priorityClassName"] == "high"
        assert pod["runtimeClassName"] == "nvidia" and pod["hostIPC"] is False
    assert launcher["nodeSelector"] == {"pool": "cpu"} and launcher["tolerations"][0]["key"] == "spot"
    assert "nodeSelector" not in worker
    (shm,) = [v for v in worker["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["containers"][0]["volumeMounts"]
    (init,) = launcher["initContainers"]
    assert init["securityContext"]["runAsUser"] == 0 and "chown 1000:1000 /work/runs" in init["command"][2]
    # --time: the deadline, as sbatch reads it
    rc, text, _ = render("--kind", "train", "--config", TRAIN, "--site", site, "--time", "12:00:00")
    assert list(yaml.safe_load_all(text))[1]["spec"]["runPolicy"]["activeDeadlineSeconds"] == 43200


def test_shm_is_on_for_gpu_jobs_and_the_cpu_example_holds_no_gpu_node(tmp_path):
    rc, text, err = render("--kind", "hpo", "--config", os.path.join(REPO, "jobs", "hpo-mlp.yaml"),
                           "--site", site_file(tmp_path, cpus_per_worker=4, memory="8Gi"),
                           "--nodes", "1", "--gpus-per-node", "0", "--tasks-per-node", "4")
    assert rc == 0, err
    worker = list(yaml.safe_load_all(text))[1]["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    assert "nodeSelector" not in worker and "tolerations" not in worker
    assert not any(v["name"] == "dshm" for v in worker["volumes"])
    assert "nvidia.com/gpu" not in worker["containers"][0]["resources"]["limits"]
    rc, text, err = render("--kind", "train", "--config", TRAIN, "--gpus-per-node", "1")
    worker = list(yaml.safe_load_all(text))[1]["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}} in worker["volumes"]
    # a GPU profile's placement on a CPU job is said, and the image default too
    gpu_site = site_file(tmp_path, node_selector={"cloud.google.com/gke-accelerator": "a100"})
    rc, _, err = render("--kind", "train", "--config", TRAIN, "--site", gpu_site)
    assert rc == 0 and "asks for no GPU but its workers' node_selector" in err
    assert "no image named" in err and "mpilearn:latest" in err


@pytest.mark.parametrize("field,value,message", [
    ("extra_pod_spec", {"containers": []}, "extra_pod_spec.containers' is set by mpilearn"),
    ("extra_pod_spec", {"runtimeClasName": "x"}, "did you mean 'runtimeClassName'"),
    ("scheduling_policy", {"minAvailible": 2}, "did you mean 'minAvailable'"),
    ("shm_size", "8Gi", "'kubernetes.shm_size' 8Gi is not below 'kubernetes.memory' 8Gi"),
    ("deadline", "tomorrow", "'kubernetes.deadline' is 'tomorrow'"),
    ("image_pull_secrets", "regcred", "'kubernetes.image_pull_secrets' must be a list"),
])
def test_bad_profile_fields_are_named(field, value, message, tmp_path):
    rc, _, err = render("--kind", "train", "--config", TRAIN, "--image", "r/m:1",
                        "--site", site_file(tmp_path, **{field: value}))
    assert rc == 2 and message in err, err


def test_a_model_file_travels_in_the_configmap_and_data_must_be_on_a_volume(tmp_path, validator):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": "models/mlp.py:build", "data": {"files": ["data/toy.h5"]}}))
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        rc, text, err = render("--kind", "train", "--config", str(config), "--image", "r/m:1",
                               "--set", "train.epochs=2")
        bad = render("--kind", "train", "--config", str(config), "--image", "r/m:1",
                     "--set", "data.files=/scratch/toy.h5")
    finally:
        os.chdir(cwd)
    assert rc == 0, err
    config_map, job = list(yaml.safe_load_all(text))
    assert config_map["data"]["mlp.py"] == open(os.path.join(REPO, "models", "mlp.py")).read()
    command = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"]
    assert command[-4:] == ["--set", "train.epochs=2", "--set", "model=/etc/mpilearn/mlp.py:build"]
    assert not errors_of(validator, job)
    assert bad[0] == 2 and "data.files: /scratch/toy.h5 is not on a volume the pods mount" in bad[2]


@pytest.mark.parametrize("status,exit_code", [(0, 0), (2, 2), (3, 3), (4, 4), (75, 143), (1, 129),
                                              (137, 137)])
def test_the_launcher_exits_permanent_for_bad_input_and_retriable_for_lost_pods(status, exit_code):
    """The operator's ExitCode policy retries 128-255 only: mpilearn's bad input (2) and the
    statuses a restart cannot cure stay below 128; a stopped run (75, an evicted pod) and a
    lost worker's mpirun status go above it."""
    import subprocess

    from mpilearn.cluster import kubernetes

    script = kubernetes.launcher_script("train", kubernetes.profile({}, {}), 2).splitlines()
    start = script.index("case $rc in")
    block = "\n".join(script[start:script.index("esac", start) + 1])
    proc = subprocess.run(["bash", "-c", f"rc={status}\n{block}\nexit $rc"], capture_output=True,
                          text=True)
    assert proc.returncode == exit_code, proc.stderr
