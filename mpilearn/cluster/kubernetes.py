"""``python -m mpilearn.jobs --target kubernetes``: a Kubeflow MPI Operator ``MPIJob``
(``kubeflow.org/v2beta1``, operator v0.8.x) from a run config and a site profile's
``kubernetes:`` section, plus a ConfigMap that carries the run config to every pod.

    python -m mpilearn.jobs --target kubernetes --kind train --config jobs/train-3dgan.yaml \\
        --site site.yaml --nodes 4 --gpus-per-node 1 --image ghcr.io/me/mpilearn:0.2 > job.yaml
    kubectl apply -f job.yaml

The operator starts one launcher pod and N worker pods (sshd), mounts a host file at
``/etc/mpi/hostfile`` in the launcher and sets ``K_MPI_JOB_ROLE`` and the MPI's host-file
variables. The launcher sizes the job from that host file at start (``--plan``, as under
SLURM), so a resized MPIJob trains on what it got, and resumes from the last checkpoint
when it is restarted (``restartPolicy: OnFailure``, up to ``runPolicy.backoffLimit``).
"""
from __future__ import annotations

import copy

import yaml

from ..errors import UsageError
from .shell import ENTRY, WAIT_FOR_LAUNCHER

# the site profile's kubernetes: section: key -> default (the default's type is the key's)
SITE = {
    "image": "mpilearn:latest",       # the image built from the Containerfile
    "name": "",                       # the MPIJob's name; default mpilearn-<kind>
    "namespace": "default",
    "workers": 1,                     # worker pods (one per node); --nodes overrides
    "slots_per_worker": 0,            # ranks per worker; 0: one per GPU, else 2
    "gpus_per_worker": 0,             # --gpus-per-node overrides
    "gpu_resource": "nvidia.com/gpu",
    "cpus_per_worker": 2,             # also OMP_NUM_THREADS = cpus / ranks per worker
    "memory": "8Gi",                  # per worker
    "node_selector": {},              # label -> value
    "tolerations": [],                # as in a pod spec
    "data_pvc": "mpilearn-data",      # mounted at <workdir>/data (the configs' data/...)
    "runs_pvc": "mpilearn-runs",      # mounted at <workdir>/runs: ReadWriteMany, shared by all pods
    "workdir": "/work",
    "mpi_implementation": "OpenMPI",  # OpenMPI | MPICH | Intel (the image's MPI)
    "backoff_limit": 6,               # launcher restarts (each resumes from the last checkpoint)
    "clean_pod_policy": "Running",    # workers deleted when the launcher ends
    "termination_grace": 300,         # seconds between SIGTERM and SIGKILL: time to checkpoint
    "ssh_auth_mount_path": "/home/mpiuser/.ssh",   # the image's user (1000)
    "sshd_config": "/home/mpiuser/.sshd_config",   # written by the image (install.sh)
}
IMPLEMENTATIONS = ("OpenMPI", "MPICH", "Intel")
CONFIG_DIR = "/etc/mpilearn"   # the ConfigMap's mount (the operator's own is /etc/mpi)


def profile(section: dict, overrides: dict, source: str = "site") -> dict:
    """The kubernetes: section checked and completed; ``overrides`` (from the command line)
    win. Unknown keys and wrong types are refused, naming the key."""
    from ..core.config import _check

    kube = copy.deepcopy(SITE)
    for layer, where in ((section or {}, source), (overrides, "command line")):
        layer = {k: v for k, v in layer.items() if v is not None}
        selector = layer.pop("node_selector", None)
        _check(layer, SITE, "kubernetes.", where)
        if selector is not None:
            if not isinstance(selector, dict) or not all(
                    isinstance(v, str) for v in selector.values()):
                raise UsageError(f"{where}: 'kubernetes.node_selector' must be a mapping of "
                                 f"label to value (strings), got {selector!r}")
            layer["node_selector"] = selector
        kube.update(layer)
    if kube["mpi_implementation"] not in IMPLEMENTATIONS:
        raise UsageError(f"{source}: 'kubernetes.mpi_implementation' is "
                         f"{kube['mpi_implementation']!r}; choose one of {', '.join(IMPLEMENTATIONS)}")
    for key in ("workers", "cpus_per_worker"):
        if kube[key] < 1:
            raise UsageError(f"{source}: 'kubernetes.{key}' must be at least 1, got {kube[key]}")
    for key in ("slots_per_worker", "gpus_per_worker", "backoff_limit", "termination_grace"):
        if kube[key] < 0:
            raise UsageError(f"{source}: 'kubernetes.{key}' must be 0 or more, got {kube[key]}")
    if not kube["runs_pvc"]:
        raise UsageError(f"{source}: 'kubernetes.runs_pvc' is empty: the run directory must be "
                         "on a volume every pod shares, or a restart cannot resume")
    return kube


def slots(kind: str, config: dict, kube: dict) -> int:
    """Ranks per worker. A sweep's training ranks are spread over the workers (one per GPU);
    its coordinator is an extra rank on the first worker, added at job start (--plan)."""
    from ..hpo.layout import sweep_tasks

    per = kube["slots_per_worker"] or kube["gpus_per_worker"] or 2
    if kind == "hpo":
        workers, gpus = sweep_tasks(config) - 1, kube["gpus_per_worker"]
        if gpus and workers != kube["workers"] * gpus:
            raise UsageError(
                f"the sweep has {workers} training ranks (search.blocks x folds x "
                f"ranks_per_fold) but {kube['workers']} worker(s) x {gpus} GPU(s) = "
                f"{kube['workers'] * gpus}: make them equal")
        per = -(-workers // kube["workers"])
    return per


def launcher_script(kind: str, kube: dict, per_worker: int) -> str:
    """The launcher container's bash script ($1 config, $2 run directory, then mpilearn
    flags): size the job from the operator's host file, launch, pass SIGTERM on as the
    checkpoint signal (SIGUSR1), exit with mpilearn's status (75: stopped, state saved)."""
    impl = kube["mpi_implementation"]
    plan = (f'NTASKS=$(python -m mpilearn.jobs --plan --kind {kind} --launcher mpirun '
            '--config "$CONFIG" --hostfile "$HOSTFILE" "$@") || exit 2')
    if impl == "OpenMPI":
        # the ranks on the workers get only what -x forwards (ssh starts a bare environment)
        forward = " ".join(f"-x {v}" for v in ("PATH", "K_MPI_JOB_ROLE", "MPILEARN_HOSTFILE",
                                                "OMP_NUM_THREADS"))
        forward += " ${LD_LIBRARY_PATH:+-x LD_LIBRARY_PATH}"  # set in CUDA images
        launch = f'mpirun -np "$NTASKS" --hostfile "$HOSTFILE" --map-by slot --bind-to none {forward}'
    else:  # Hydra (MPICH, Intel MPI) forwards the whole environment
        launch = 'mpirun -n "$NTASKS" -f "$HOSTFILE"'
    threads = max(1, kube["cpus_per_worker"] // max(1, per_worker))
    lines = [
        "set -uo pipefail",
        'CONFIG=$1; OUTPUT=$2; shift 2',
        'echo "mpilearn: MPIJob launcher $HOSTNAME (role ${K_MPI_JOB_ROLE:-?}): $CONFIG -> $OUTPUT"',
        'mkdir -p "$OUTPUT" || exit 2',
        # on the shared runs volume: the ranks read it back to name the MPIJob in their log
        'export MPILEARN_HOSTFILE="$OUTPUT/hosts-$HOSTNAME"; HOSTFILE=$MPILEARN_HOSTFILE',
        f"export OMP_NUM_THREADS={threads}",
        plan,
        f'{launch} python -m {ENTRY[kind]} --config "$CONFIG" --output "$OUTPUT" '
        '--resume auto --no-progress "$@" &',
        "pid=$!",
        "trap 'kill -USR1 $pid 2>/dev/null' TERM",
        *WAIT_FOR_LAUNCHER,
        *([] if kind != "train" else [
            # Open MPI 5's mpirun was seen to exit 0 after losing a worker's daemon (a deleted
            # pod): a training run that ended without its final models did not finish
            'if [ $rc -eq 0 ] && ! ls "$OUTPUT/models" 2>/dev/null | grep -qE "[.](pt|keras)$"; '
            'then rc=1; fi']),
        # mpilearn said why for 2 (bad input) and 75 (stopped, state saved); a lost worker
        # pod or a crash ends mpirun with its own report: say what happens next, once
        'case $rc in 0|2|75) ;; *) echo "mpilearn: mpirun ended with status $rc (a worker pod '
        'lost, or a rank failed: see above); a restart of the launcher resumes from the last '
        'checkpoint" >&2 ;; esac',
        'exit $rc',
    ]
    return "\n".join(lines) + "\n"


# The worker container: sshd, as the operator expects. kubectl delete sends SIGTERM to every
# pod at once, and sshd would end at once with its pod and the ranks in it; the ranks need the
# grace period to checkpoint (the launcher's SIGTERM reaches them through mpirun), so the pod
# stays until they and the MPI daemon (which reports their exit to mpirun over this sshd) have
# ended ([p]: the pattern must not match this script itself).
WORKER = """/usr/sbin/sshd -De -f "$1" & sshd=$!
trap 'while pgrep -f "[p]ython -m mpilearn|[p]rted|[o]rted|[h]ydra_pmi_proxy" >/dev/null
      do sleep 1; done; kill $sshd' TERM
wait $sshd; wait $sshd
"""


def _volumes(kube: dict, name: str) -> tuple:
    mounts = [{"name": "data", "mountPath": f"{kube['workdir']}/data"},
              {"name": "runs", "mountPath": f"{kube['workdir']}/runs"},
              {"name": "mpilearn-config", "mountPath": CONFIG_DIR, "readOnly": True}]
    volumes = [{"name": "runs", "persistentVolumeClaim": {"claimName": kube["runs_pvc"]}},
               {"name": "mpilearn-config", "configMap": {"name": f"{name}-mpilearn"}}]
    volumes.insert(0, {"name": "data", "persistentVolumeClaim": {"claimName": kube["data_pvc"]}}
                   if kube["data_pvc"] else {"name": "data", "emptyDir": {}})
    return mounts, volumes


def manifest(kind: str, config: dict, config_text: str, output: str, kube: dict,
             sets=()) -> list:
    """[ConfigMap, MPIJob] as dicts."""
    name = kube["name"] or f"mpilearn-{kind}"
    per_worker = slots(kind, config, kube)
    mounts, volumes = _volumes(kube, name)
    labels = {"app.kubernetes.io/name": "mpilearn", "mpilearn/kind": kind}
    worker_limits = {"cpu": kube["cpus_per_worker"], "memory": kube["memory"]}
    if kube["gpus_per_worker"]:
        worker_limits[kube["gpu_resource"]] = kube["gpus_per_worker"]
    pod = {"terminationGracePeriodSeconds": kube["termination_grace"],
           "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000},
           "volumes": volumes}
    launcher = {
        "name": "mpilearn-launcher", "image": kube["image"], "workingDir": kube["workdir"],
        "command": ["bash", "-c", launcher_script(kind, kube, per_worker), "mpilearn-launcher",
                    f"{CONFIG_DIR}/config.yaml", output] + [a for s in sets for a in ("--set", s)],
        "resources": {"requests": {"cpu": 1, "memory": "1Gi"},
                      "limits": {"cpu": 1, "memory": "2Gi"}},
        "volumeMounts": mounts}
    if kube["gpus_per_worker"]:
        # the launcher pod sees no GPU: it learns the workers' count for --plan from here
        launcher["env"] = [{"name": "MPILEARN_GPUS_PER_WORKER",
                            "value": str(kube["gpus_per_worker"])}]
    worker = {"name": "mpilearn-worker", "image": kube["image"], "workingDir": kube["workdir"],
              "command": ["bash", "-c", WORKER, "mpilearn-worker", kube["sshd_config"]],
              "resources": {"requests": dict(worker_limits), "limits": worker_limits},
              "volumeMounts": mounts}
    worker_pod = {**copy.deepcopy(pod), "containers": [worker]}
    if kube["node_selector"]:
        worker_pod["nodeSelector"] = dict(kube["node_selector"])
    if kube["tolerations"]:
        worker_pod["tolerations"] = copy.deepcopy(kube["tolerations"])
    job = {
        "apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob",
        "metadata": {"name": name, "namespace": kube["namespace"], "labels": labels},
        "spec": {
            "slotsPerWorker": per_worker,
            "mpiImplementation": kube["mpi_implementation"],
            "sshAuthMountPath": kube["ssh_auth_mount_path"],
            "launcherCreationPolicy": "WaitForWorkersReady",
            "runPolicy": {"backoffLimit": kube["backoff_limit"],
                          "cleanPodPolicy": kube["clean_pod_policy"]},
            "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "restartPolicy": "OnFailure",
                             "template": {"metadata": {"labels": labels},
                                          "spec": {**pod, "containers": [launcher]}}},
                "Worker": {"replicas": kube["workers"], "restartPolicy": "OnFailure",
                           "template": {"metadata": {"labels": labels}, "spec": worker_pod}},
            },
        },
    }
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": f"{name}-mpilearn", "namespace": kube["namespace"],
                               "labels": labels},
                  "data": {"config.yaml": config_text}}
    return [config_map, job]


def render(kind: str, config_path: str, output: str, config: dict, kube: dict,
           sets=()) -> str:
    if output.startswith("/") or output.split("/")[0] != "runs":
        raise UsageError(f"run directory {output!r}: on Kubernetes it must be under runs/ (the "
                         "runs volume, shared by the pods, kept after the job); pass --output "
                         f"runs/...")
    with open(config_path) as f:
        text = f.read()
    config_map, job = manifest(kind, config, text, output, kube, sets)
    name, ns = job["metadata"]["name"], kube["namespace"]
    per, workers = job["spec"]["slotsPerWorker"], kube["workers"]
    ranks = (f"{workers} worker(s) x {per} rank(s)" +
             (" + the sweep's coordinator on the first worker" if kind == "hpo" else ""))
    head = [
        f"# rendered by: python -m mpilearn.jobs --target kubernetes --kind {kind} from "
        f"{config_path}: {ranks}",
        "# needs the Kubeflow MPI Operator v0.8.x; the PVCs "
        f"{kube['data_pvc'] or '(no data PVC: emptyDir)'} and {kube['runs_pvc']} "
        "(ReadWriteMany) in the namespace",
        f"#   kubectl apply -f THIS_FILE && kubectl -n {ns} logs -f job/{name}-launcher",
        "# resize: the ranks follow the operator's host file at job start, so edit "
        "Worker.replicas (and slotsPerWorker) here,",
        f"#   or kubectl -n {ns} patch mpijob {name} --type=merge -p "
        "'{\"spec\":{\"mpiReplicaSpecs\":{\"Worker\":{\"replicas\":N}}}}' and restart the "
        "launcher; the run resumes from its last checkpoint",
        f"# stop: kubectl -n {ns} delete mpijob {name} sends SIGTERM; mpilearn checkpoints within "
        f"terminationGracePeriodSeconds ({kube['termination_grace']} s)",
    ]
    body = yaml.dump_all([config_map, job], Dumper=_Dumper, sort_keys=False, allow_unicode=True,
                          default_flow_style=False, width=100)
    return "\n".join(head) + "\n" + body


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the launcher script, the run config) as readable | blocks; no
    anchors (kubectl users read and edit these files)."""

    def ignore_aliases(self, data):
        return True


_Dumper.add_representer(str, lambda d, s: d.represent_scalar(
    "tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))
