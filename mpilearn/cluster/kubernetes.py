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
when it is restarted (up to ``runPolicy.backoffLimit``).

The launcher's restart policy is the operator's ``ExitCode``: 1-127 permanent, 128-255
retried (kubeflow/mpi-operator pkg/apis/kubeflow/v2beta1/types.go). The launcher script
therefore keeps mpilearn's permanent statuses (2 bad input, 3 training cannot continue, 4 no
trial succeeded) and turns the ones a restart can cure into 128+: 75 (stopped with its state
saved: an evicted or drained pod) becomes 143, a lost worker's mpirun status n becomes 128+n.
Operator v0.8.x does not yet act on the classes (it sets the pod's restartPolicy to Never and
its launcher Job retries every failed pod: kubeflow/mpi-operator#537), so the render-time
checks (cluster/jobcheck.py) are what keeps a bad input from being retried there.

A model file (``model: path/to/file.py``) travels in the job's ConfigMap beside the run
config, mounted at /etc/mpilearn in every pod; the launcher runs with
``--set model=/etc/mpilearn/<file>``. A model given as a module (``mpilearn.models.mlp``) is
the image's.
"""
from __future__ import annotations

import copy
import re

import yaml

from ..errors import UsageError
from .carry import CONFIG_DIR, carried_model, model_file
from .shell import ENTRY, WAIT_FOR_LAUNCHER, ulfm_flag

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
    "shm_size": "auto",               # /dev/shm (emptyDir, medium Memory): auto = 4Gi with GPUs,
                                      # none without; a size (16Gi); "none"/"0": none
    "image_pull_secrets": [],         # Secret names for a private registry
    "service_account": "",            # serviceAccountName of both pods
    "priority_class": "",             # priorityClassName of both pods
    "launcher_node_selector": {},     # the launcher's own placement (a CPU pod): label -> value
    "launcher_tolerations": [],
    "gang": False,                    # runPolicy.schedulingPolicy.minAvailable = workers + 1
    "scheduling_policy": {},          # runPolicy.schedulingPolicy as the CRD spells it (queue, ...)
    "deadline": "",                   # runPolicy.activeDeadlineSeconds: seconds or D-HH:MM:SS;
                                      # --time overrides
    "ttl_after_finished": -1,         # runPolicy.ttlSecondsAfterFinished (-1: kept)
    "queue": "",                      # Kueue: the label kueue.x-k8s.io/queue-name
    "suspend": False,                 # runPolicy.suspend: created suspended (Kueue admits it)
    "runs_chown": False,              # an initContainer (root) chowns <workdir>/runs to 1000:
                                      # NFS ignores fsGroup (needs no_root_squash)
    "extra_pod_spec": {},             # more pod-spec fields for both pods, as Kubernetes spells them
}
UID = 1000                         # the image's user (containers/install.sh user)
SHM_AUTO = "4Gi"
SCHEDULING_POLICY = ("minAvailable", "queue", "minResources", "priorityClass",
                     "scheduleTimeoutSeconds")
# pod-spec fields the profile's own keys set: extra_pod_spec may not set them
OWN_POD_FIELDS = {"containers": "the image and resources keys", "volumes": "data_pvc, runs_pvc, shm_size",
                  "initContainers": "runs_chown", "securityContext": "(the image's user 1000)",
                  "nodeSelector": "node_selector", "tolerations": "tolerations",
                  "imagePullSecrets": "image_pull_secrets", "serviceAccountName": "service_account",
                  "priorityClassName": "priority_class", "restartPolicy": "(the operator's)",
                  "terminationGracePeriodSeconds": "termination_grace"}
# the PodSpec's fields (Kubernetes 1.33, as in the operator's CRD): a typo is named
POD_FIELDS = ("activeDeadlineSeconds", "affinity", "automountServiceAccountToken", "containers",
              "dnsConfig", "dnsPolicy", "enableServiceLinks", "ephemeralContainers",
              "hostAliases", "hostIPC", "hostNetwork", "hostPID", "hostUsers", "hostname",
              "imagePullSecrets", "initContainers", "nodeName", "nodeSelector", "os", "overhead",
              "preemptionPolicy", "priority", "priorityClassName", "readinessGates",
              "resourceClaims", "resources", "restartPolicy", "runtimeClassName",
              "schedulerName", "schedulingGates", "securityContext", "serviceAccount",
              "serviceAccountName", "setHostnameAsFQDN", "shareProcessNamespace", "subdomain",
              "terminationGracePeriodSeconds", "tolerations", "topologySpreadConstraints",
              "volumes")
QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")
UNITS = {None: 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
         "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
CONFIGMAP_LIMIT = 1 << 20          # what one ConfigMap holds (etcd's object limit)
IMPLEMENTATIONS = ("OpenMPI", "MPICH", "Intel")


def profile(section: dict, overrides: dict, source: str = "site") -> dict:
    """The kubernetes: section checked and completed; ``overrides`` (from the command line)
    win. Unknown keys and wrong types are refused, naming the key."""
    from ..core.config import _check

    kube = copy.deepcopy(SITE)
    for layer, where in ((section or {}, source), (overrides, "command line")):
        layer = {k: v for k, v in layer.items() if v is not None}
        free = {k: layer.pop(k) for k in ("node_selector", "launcher_node_selector",
                                          "scheduling_policy", "extra_pod_spec", "deadline")
                if k in layer}
        _check(layer, SITE, "kubernetes.", where)
        for key in ("node_selector", "launcher_node_selector"):
            if key in free and (not isinstance(free[key], dict) or not all(
                    isinstance(v, str) for v in free[key].values())):
                raise UsageError(f"{where}: 'kubernetes.{key}' must be a mapping of "
                                 f"label to value (strings), got {free[key]!r}")
        if "deadline" in free:
            free["deadline"] = deadline_seconds(free["deadline"], f"{where}: 'kubernetes.deadline'")
        for key in ("scheduling_policy", "extra_pod_spec"):
            if key in free and not isinstance(free[key], dict):
                raise UsageError(f"{where}: 'kubernetes.{key}' must be a mapping, got {free[key]!r}")
        layer.update(free)
        kube.update(layer)
    _check_fields(kube, source)
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
    if kube["ttl_after_finished"] < -1:
        raise UsageError(f"{source}: 'kubernetes.ttl_after_finished' must be -1 (keep the job) "
                         f"or 0 or more seconds, got {kube['ttl_after_finished']}")
    kube["shm"] = shm_size(kube, source)
    return kube


def deadline_seconds(value, where: str) -> int:
    """Seconds from an integer or a SLURM time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM,
    D-HH:MM:SS); 0 or "": none."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise UsageError(f"{where} must be seconds or a time such as 12:00:00, got {value!r}")
    if isinstance(value, int) or value.strip().isdigit() and ":" not in value and "-" not in value:
        seconds = int(value) * (1 if isinstance(value, int) else 60)  # SLURM's lone number: minutes
    else:
        m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", value.strip())
        if not m:
            raise UsageError(f"{where} is {value!r}: give seconds or a SLURM time such as "
                             "12:00:00 or 2-00:00:00")
        days, a, b, c = (int(x) if x else None for x in m.groups())
        if days is not None:  # D-HH[:MM[:SS]]
            seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
        elif c is not None:   # HH:MM:SS
            seconds = a * 3600 + b * 60 + c
        else:                 # MM[:SS]
            seconds = a * 60 + (b or 0)
    if seconds < 0:
        raise UsageError(f"{where} must be 0 or more, got {value!r}")
    return seconds


def quantity(text: str, where: str) -> float:
    m = QUANTITY.match(str(text))
    if not m:
        raise UsageError(f"{where} is {text!r}: give a Kubernetes quantity such as 8Gi or 512Mi")
    return float(m.group(1)) * UNITS[m.group(2)]


def shm_size(kube: dict, source: str) -> str:
    """The /dev/shm volume's size, or "" for none. It counts against the worker's memory
    limit (a Memory emptyDir), so it must stay below it."""
    size = kube["shm_size"]
    if size == "auto":
        size = SHM_AUTO if kube["gpus_per_worker"] else ""
    if size in ("", "none", "0"):
        return ""
    if quantity(size, f"{source}: 'kubernetes.shm_size'") >= quantity(
            kube["memory"], f"{source}: 'kubernetes.memory'"):
        raise UsageError(f"{source}: 'kubernetes.shm_size' {size} is not below 'kubernetes.memory' "
                         f"{kube['memory']}: /dev/shm is memory the worker's limit counts")
    return size


def _check_fields(kube: dict, source: str) -> None:
    """The pass-through fields: names the CRD knows, none that a profile key sets."""
    from ..train.checks import did_you_mean

    for key in kube["scheduling_policy"]:
        if key not in SCHEDULING_POLICY:
            raise UsageError(f"{source}: 'kubernetes.scheduling_policy.{key}' is not a field of "
                             f"the MPIJob's runPolicy.schedulingPolicy{did_you_mean(key, SCHEDULING_POLICY)}; "
                             f"it has: {', '.join(SCHEDULING_POLICY)}")
    for key in kube["extra_pod_spec"]:
        if key in OWN_POD_FIELDS:
            raise UsageError(f"{source}: 'kubernetes.extra_pod_spec.{key}' is set by mpilearn: "
                             f"use {OWN_POD_FIELDS[key]} instead")
        if key not in POD_FIELDS:
            raise UsageError(f"{source}: 'kubernetes.extra_pod_spec.{key}' is not a pod-spec "
                             f"field{did_you_mean(key, POD_FIELDS)}")
    for key in ("image_pull_secrets",):
        if not isinstance(kube[key], list) or not all(isinstance(v, str) and v for v in kube[key]):
            raise UsageError(f"{source}: 'kubernetes.{key}' must be a list of Secret names, got "
                             f"{kube[key]!r}")
    for key in ("tolerations", "launcher_tolerations"):
        if not isinstance(kube[key], list) or not all(isinstance(v, dict) for v in kube[key]):
            raise UsageError(f"{source}: 'kubernetes.{key}' must be a list of tolerations "
                             f"(mappings such as {{key: nvidia.com/gpu, operator: Exists}}), got "
                             f"{kube[key]!r}")


def gpu_placement_without_gpus(kube: dict) -> list:
    """Node selectors and tolerations that name GPUs, on a job that asks for none (a CPU run
    rendered with a GPU profile would hold GPU nodes)."""
    if kube["gpus_per_worker"]:
        return []
    named = [f"node_selector {k}: {v}" for k, v in kube["node_selector"].items()
             if re.search("gpu|accelerator|nvidia", f"{k}={v}", re.I)]
    named += [f"toleration {t.get('key')}" for t in kube["tolerations"]
              if re.search("gpu|nvidia", str(t.get("key", "")), re.I)]
    return named


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


def launcher_script(kind: str, kube: dict, per_worker: int, ulfm: str = "") -> str:
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
        launch = (f'mpirun -np "$NTASKS" --hostfile "$HOSTFILE" --map-by slot --bind-to none{ulfm} '
                  f'{forward}')
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
        # the operator's ExitCode policy: 1-127 permanent, 128-255 retried. mpilearn said why
        # for 2 (bad input), 3 (cannot continue) and 4 (no trial succeeded): permanent. 75
        # (stopped, state saved: an evicted pod) and a lost worker or crash (mpirun's own
        # report) are retried and resume from the last checkpoint: say so, once
        'case $rc in',
        '  0|2|3|4) ;;',
        '  75) echo "mpilearn: stopped with its state saved; exit 143 so that a restart of the '
        'launcher resumes" >&2; rc=143 ;;',
        '  *) [ $rc -ge 128 ] || rc=$((rc + 128))',
        '     echo "mpilearn: mpirun ended with status $rc (a worker pod lost, or a rank failed: '
        'see above); a restart of the launcher resumes from the last checkpoint" >&2 ;;',
        'esac',
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
    if kube["shm"]:  # NCCL and data loaders need more than the runtime's 64 MB
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory",
                                                     "sizeLimit": kube["shm"]}})
    return mounts, volumes


def _chown_runs(kube: dict) -> dict:
    """An init container (root) that gives the runs volume's top directory to the image's
    user: fsGroup does not apply to NFS volumes, and a fresh export is root's. The export
    must allow root (no_root_squash); otherwise make it UID 1000's on the server (or
    all_squash with anonuid=1000)."""
    runs = f"{kube['workdir']}/runs"
    return {"name": "mpilearn-runs-owner", "image": kube["image"],
            "command": ["sh", "-c", f"chown {UID}:{UID} {runs} && chmod u+rwx {runs}"],
            "securityContext": {"runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False},
            "volumeMounts": [{"name": "runs", "mountPath": runs}]}


def _pod_fields(kube: dict) -> dict:
    """The fields both pods share beyond volumes and containers."""
    pod = {}
    if kube["image_pull_secrets"]:
        pod["imagePullSecrets"] = [{"name": n} for n in kube["image_pull_secrets"]]
    if kube["service_account"]:
        pod["serviceAccountName"] = kube["service_account"]
    if kube["priority_class"]:
        pod["priorityClassName"] = kube["priority_class"]
    pod.update(copy.deepcopy(kube["extra_pod_spec"]))
    return pod


def _run_policy(kube: dict) -> dict:
    policy = {"backoffLimit": kube["backoff_limit"], "cleanPodPolicy": kube["clean_pod_policy"]}
    if kube["deadline"]:
        policy["activeDeadlineSeconds"] = kube["deadline"]
    if kube["ttl_after_finished"] >= 0:
        policy["ttlSecondsAfterFinished"] = kube["ttl_after_finished"]
    scheduling = dict(kube["scheduling_policy"])
    if kube["gang"]:  # all pods or none: the launcher and every worker
        scheduling.setdefault("minAvailable", kube["workers"] + 1)
    if scheduling:
        policy["schedulingPolicy"] = scheduling
    if kube["suspend"]:
        policy["suspend"] = True
    return policy


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
           "securityContext": {"runAsUser": UID, "runAsGroup": UID, "fsGroup": UID},
           **_pod_fields(kube), "volumes": volumes}
    model = carried_model(config, kube)
    sets = list(sets) + [model[2]] if model else list(sets)  # after the user's: it wins
    launcher = {
        "name": "mpilearn-launcher", "image": kube["image"], "workingDir": kube["workdir"],
        "command": ["bash", "-c", launcher_script(kind, kube, per_worker, ulfm_flag(kind, config)),
                    "mpilearn-launcher",
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
    launcher_pod = {**copy.deepcopy(pod), "containers": [launcher]}
    if kube["runs_chown"]:
        launcher_pod["initContainers"] = [_chown_runs(kube)]
    if kube["launcher_node_selector"]:
        launcher_pod["nodeSelector"] = dict(kube["launcher_node_selector"])
    if kube["launcher_tolerations"]:
        launcher_pod["tolerations"] = copy.deepcopy(kube["launcher_tolerations"])
    job_labels = dict(labels)
    if kube["queue"]:
        job_labels["kueue.x-k8s.io/queue-name"] = kube["queue"]
    job = {
        "apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob",
        "metadata": {"name": name, "namespace": kube["namespace"], "labels": job_labels},
        "spec": {
            "slotsPerWorker": per_worker,
            "mpiImplementation": kube["mpi_implementation"],
            "sshAuthMountPath": kube["ssh_auth_mount_path"],
            "launcherCreationPolicy": "WaitForWorkersReady",
            "runPolicy": _run_policy(kube),
            "mpiReplicaSpecs": {
                # ExitCode: mpilearn's permanent statuses are not retried (launcher_script)
                "Launcher": {"replicas": 1, "restartPolicy": "ExitCode",
                             "template": {"metadata": {"labels": labels},
                                          "spec": launcher_pod}},
                "Worker": {"replicas": kube["workers"], "restartPolicy": "OnFailure",
                           "template": {"metadata": {"labels": labels}, "spec": worker_pod}},
            },
        },
    }
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": f"{name}-mpilearn", "namespace": kube["namespace"],
                               "labels": labels},
                  "data": {"config.yaml": config_text}}
    if model:
        config_map["data"].update(model[0])
    size = sum(len(k) + len(v.encode()) for k, v in config_map["data"].items())
    if size > CONFIGMAP_LIMIT - 4096:  # room for the object's metadata
        raise UsageError(f"the run config and model file are {size} bytes, more than a "
                         f"ConfigMap holds (1 MiB): put the model in the image (model: a module) "
                         f"or on the data volume (model: {kube['workdir']}/data/...)")
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
        "# restarts: the launcher's exit 2 (bad input), 3 and 4 are permanent, 128+ (a lost "
        "worker, an evicted pod) retried and resumed",
    ]
    model = carried_model(config, kube)
    if model:
        beside = sorted(set(model[0]) - {model[1]})
        head.append(f"# the model file {model_file(config)} travels in the ConfigMap: "
                    f"{CONFIG_DIR}/{model[1]} in every pod (--set {model[2]})"
                    + (f", with the modules it imports: {', '.join(beside)}"
                       if beside else ""))
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
