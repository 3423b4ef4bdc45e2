"""An MPIJob's pods on one machine, as the Kubeflow MPI Operator (v0.8) runs them.

Each pod is a network namespace (``ip netns``) with its own address on a bridge and, in its
own UTS and mount namespaces, its own host name, ``/etc/hosts`` (the job's Service names) and
ssh set-up. The workers run ``sshd -De`` on port 2222 with the configuration that
``containers/install.sh sshd`` writes into the image; the launcher gets the operator's host
file (``NAME-worker-I.NAME.NAMESPACE.svc slots=N``), its environment (``K_MPI_JOB_ROLE``,
``OMPI_MCA_*``) and the job's key pair at ``~/.ssh`` (the operator's Secret at
``sshAuthMountPath``). The file system is shared, as a ReadWriteMany runs volume is. Needs root.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "mlk"            # namespaces mlk0 (launcher), mlk1, mlk2 (workers); bridge mlkbr0
NET = "10.232.0"          # launcher .10, workers .1 and .2
PORT = 2222


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def missing() -> list:
    tools = ("ip", "nsenter", "unshare", "ssh", "ssh-keygen", "/usr/sbin/sshd")
    return [t for t in tools if shutil.which(t) is None]


class MPIJobPods:
    def __init__(self, root: str, job: str = "mpilearn-train", namespace: str = "default",
                 workers: int = 2, slots: int = 2):
        self.root, self.job, self.namespace = root, job, namespace
        self.workers = [f"{job}-worker-{i}" for i in range(workers)]
        self.launcher = f"{job}-launcher"
        self.slots = slots
        self.sshd = {}  # worker index -> Popen
        self.worker_command = ["/usr/sbin/sshd", "-De", "-f", ".sshd_config"]

    def fqdn(self, name: str) -> str:
        return f"{name}.{self.job}.{self.namespace}.svc"

    def path(self, *parts) -> str:
        return os.path.join(self.root, *parts)

    # -- set-up -----------------------------------------------------------------------------
    def start(self, worker_command: list = None) -> "MPIJobPods":
        """``worker_command``: the worker container's command from the rendered manifest."""
        self.worker_command = worker_command or self.worker_command
        self._teardown_network()
        bridge = f"{PREFIX}br0"
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        pods = [(0, 10)] + [(i + 1, i + 1) for i in range(len(self.workers))]
        for index, host in pods:
            ns, a, b = f"{PREFIX}{index}", f"{PREFIX}{index}h", f"{PREFIX}{index}c"
            _ip("netns", "add", ns)
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            _ip("link", "set", b, "netns", ns)
            _ip("link", "set", a, "master", bridge)
            _ip("link", "set", a, "up")
            _ip("netns", "exec", ns, "ip", "addr", "add", f"{NET}.{host}/24", "dev", b)
            _ip("netns", "exec", ns, "ip", "link", "set", b, "up")
            _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        # the job's Service: every pod reaches the others by FQDN (Open MPI keeps it:
        # OMPI_MCA_orte_keep_fqdn_hostnames) or short name
        with open(self.path("hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n")
            for i, name in enumerate(self.workers):
                f.write(f"{NET}.{i + 1} {self.fqdn(name)} {name}\n")
            f.write(f"{NET}.10 {self.fqdn(self.launcher)} {self.launcher}\n")
        # the operator's Secret: one key pair, its public key authorised everywhere
        ssh = self.path("ssh")
        os.makedirs(ssh, exist_ok=True)
        if not os.path.exists(os.path.join(ssh, "id_rsa")):
            subprocess.run(["ssh-keygen", "-q", "-t", "rsa", "-N", "", "-f",
                            os.path.join(ssh, "id_rsa")], check=True)
        shutil.copy(os.path.join(ssh, "id_rsa.pub"), os.path.join(ssh, "authorized_keys"))
        # the image's ssh set-up, from the image's own script; the home holds the Secret
        install = os.path.join(REPO, "containers", "install.sh")
        subprocess.run(["bash", install, "sshd", self.path("etc-ssh"), self.path("home"),
                        str(PORT)], check=True, capture_output=True)
        home_ssh = self.path("home", ".ssh")
        open(self.path("home", ".bashrc"), "w").close()
        for name in ("id_rsa", "id_rsa.pub", "authorized_keys"):
            shutil.copy(os.path.join(ssh, name), home_ssh)
        # the image has MPI and python on sshd's default PATH; here they are in the venv, and
        # the code under test is this checkout
        venv_bin = os.path.dirname(sys.executable)
        self.session_env = (f"PATH={venv_bin}:/usr/bin:/bin PYTHONPATH={REPO} "
                            "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        for i in range(len(self.workers)):
            self.start_worker(i)
        return self

    def _pod(self, index: int, hostname: str, command: list, pid: bool = False,
             **kw) -> subprocess.Popen:
        """``command`` in pod ``index``'s namespaces, with its host name and /etc/hosts;
        ``pid``: in its own PID namespace too (its processes see only each other)."""
        # the pod's shell start-up is the image's (none), not this machine's ~/.bashrc, which
        # sshd's bash would read for every session (here: pyenv, whose rehash lock, left by a
        # killed pod, held each ssh login for 60 s)
        script = ('mount --bind "$1" /etc/hosts && mount --bind "$2" /etc/ssh/ssh_config && '
                  'mount --bind "$3" "$HOME/.ssh" && hostname "$4" && '
                  '{ [ ! -e "$HOME/.bashrc" ] || mount --bind "$5" "$HOME/.bashrc"; } && '
                  'shift 5 && exec "$@"')
        os.makedirs(os.path.expanduser("~/.ssh"), exist_ok=True)
        # nsenter, not `ip netns exec`: that mounts a fresh /sys
        return subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{PREFIX}{index}", "unshare", "--uts", "--mount",
             *(["--pid", "--fork", "--mount-proc"] if pid else []), "sh", "-c", script, "pod", self.path("hosts"), self.path("etc-ssh", "ssh_config"),
             self.path("home", ".ssh"), hostname, self.path("home", ".bashrc"), *command], **kw)

    def start_worker(self, i: int) -> None:
        """The worker pod's container: the rendered worker command (sshd -De -f CONFIG).
        A (re)created pod starts with its own empty /tmp, as a container does: here the pods
        share one file system, and their PID namespaces hand out the same PIDs, so Open MPI's
        daemons would meet in one /tmp/prted.PID session directory (or find a deleted pod's)
        and fail to start. TMPDIR stands in for the pod's own /tmp."""
        log = open(self.path(f"sshd-{i}.log"), "a")
        tmp = self.path(f"tmp-{self.workers[i]}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        config = self.path("home", f".sshd_config-{i}")
        shutil.copy(self.path("home", ".sshd_config"), config)
        with open(config, "a") as f:
            f.write(f"SetEnv {self.session_env} TMPDIR={tmp}\n")
        command = [config if a.endswith(".sshd_config") else a for a in self.worker_command]
        self.sshd[i] = self._pod(i + 1, self.workers[i], command, pid=True,
                                 stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the launcher waits for ready workers
            probe = subprocess.run(["ip", "netns", "exec", f"{PREFIX}{i + 1}", "ss", "-ltn"],
                                   capture_output=True, text=True)
            if f":{PORT} " in probe.stdout:
                return
            time.sleep(0.1)
        raise RuntimeError(f"sshd of {self.workers[i]} did not start:\n"
                           + open(self.path(f"sshd-{i}.log")).read())

    def terminate_worker(self, i: int) -> None:
        """What the kubelet does first when a pod is deleted: SIGTERM to the container's
        first process (PID 1 in the pod; `unshare --fork` is its parent here)."""
        with open(f"/proc/{self.sshd[i].pid}/task/{self.sshd[i].pid}/children") as f:
            first = int(f.read().split()[0])
        os.kill(first, signal.SIGTERM)

    def kill_worker(self, i: int) -> list:
        """A deleted pod: every process in its namespace is killed (sshd, prted, the ranks)."""
        pids = [int(p) for p in _ip("netns", "pids", f"{PREFIX}{i + 1}").stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if i in self.sshd:
            self.sshd.pop(i).wait()
        return pids

    # -- the launcher -----------------------------------------------------------------------
    def hostfile(self, implementation: str = "OpenMPI") -> str:
        """The operator's ConfigMap: newConfigMap in pkg/controller/mpi_job_controller.go."""
        path = self.path("etc-mpi", "hostfile")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            for name in self.workers:
                f.write(f"{self.fqdn(name)} slots={self.slots}\n" if implementation == "OpenMPI"
                        else f"{self.fqdn(name)}:{self.slots}\n")
        return path

    def launcher_env(self, base: dict) -> dict:
        """The launcher container's environment as the operator sets it (OpenMPI)."""
        return {**base, "K_MPI_JOB_ROLE": "launcher",
                "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
                "OMPI_MCA_orte_default_hostfile": self.hostfile(),
                "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10",
                "OMPI_MCA_orte_set_default_slots": str(self.slots),
                "NVIDIA_VISIBLE_DEVICES": "", "NVIDIA_DRIVER_CAPABILITIES": "",
                "PYTHONPATH": REPO}

    def launch(self, command: list, env: dict, cwd: str, **kw) -> subprocess.Popen:
        """The launcher pod's container running ``command`` (the manifest's)."""
        return self._pod(0, self.launcher, command, env=self.launcher_env(env), cwd=cwd,
                         start_new_session=True, **kw)

    # -- tear-down --------------------------------------------------------------------------
    def processes(self) -> list:
        out = []
        for index in range(len(self.workers) + 1):
            out += _ip("netns", "pids", f"{PREFIX}{index}", check=False).stdout.split()
        return out

    def stop(self) -> None:
        for i in list(self.sshd):
            self.kill_worker(i)
        for pid in self.processes():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._teardown_network()

    def _teardown_network(self) -> None:
        for index in range(len(self.workers) + 1):
            _ip("netns", "del", f"{PREFIX}{index}", check=False)
            _ip("link", "del", f"{PREFIX}{index}h", check=False)
        _ip("link", "del", f"{PREFIX}br0", check=False)
