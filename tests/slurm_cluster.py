"""A real one-node SLURM cluster for the tests: munged, slurmctld and slurmd as root.

Everything lives in one temporary directory (config, munge key and socket, state, logs) on
free ports, so it touches nothing of the machine's own SLURM or munge set-up, and
:meth:`Cluster.stop` leaves no daemon behind. ``make test`` installs the Debian packages
(slurm-wlm, munge, libpmix-dev) when it runs as root.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

DAEMONS = ("munged", "slurmctld", "slurmd")
PMIX = "/usr/lib/x86_64-linux-gnu/libpmix.so"


def missing() -> list:
    need = [d for d in DAEMONS + ("sbatch", "srun") if shutil.which(d) is None]
    if not os.path.exists(PMIX) and not any(
            os.path.exists(os.path.join(d, "libpmix.so")) for d in ("/usr/lib64", "/usr/lib")):
        need.append("libpmix.so (libpmix-dev)")
    return need


def _free_ports(n: int) -> list:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Cluster:
    def __init__(self, cpus: int = 8, preemption: bool = False):
        """``preemption``: a job in the partition ``urgent`` preempts jobs of the default
        partition (PreemptMode=REQUEUE, SIGTERM then GraceTime seconds to stop)."""
        self.preemption = preemption
        self.dir = tempfile.mkdtemp(prefix="mpilearn-slurm-")
        self.host = socket.gethostname()
        self.cpus = cpus
        self.env = {**os.environ, "SLURM_CONF": os.path.join(self.dir, "slurm.conf")}
        self.pidfiles = []

    def path(self, *parts) -> str:
        return os.path.join(self.dir, *parts)

    def _write_config(self) -> None:
        for sub in ("state", "spool", "log", "munge"):
            os.makedirs(self.path(sub), exist_ok=True)
        os.chmod(self.path("munge"), 0o755)
        with open(self.path("munge.key"), "wb") as f:
            f.write(os.urandom(128))
        os.chmod(self.path("munge.key"), 0o600)
        ctld, slurmd = _free_ports(2)
        conf = f"""\
ClusterName=mpilearn-test
SlurmctldHost={self.host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.path('munge', 'sock')}
StateSaveLocation={self.path('state')}
SlurmdSpoolDir={self.path('spool')}
SlurmctldPidFile={self.path('slurmctld.pid')}
SlurmdPidFile={self.path('slurmd.pid')}
SlurmctldLogFile={self.path('log', 'slurmctld.log')}
SlurmdLogFile={self.path('log', 'slurmd.log')}
SlurmctldPort={ctld}
SlurmdPort={slurmd}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobRequeue=1
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# start a submitted or newly eligible job at once, not up to 3 s later (the tests wait on it)
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
MinJobAge=600
KillWait=20
NodeName={self.host} CPUs={self.cpus} RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        if self.preemption:
            conf = conf.replace(
                "PartitionName=debug",
                "PreemptType=preempt/partition_prio\nPreemptMode=REQUEUE\nPartitionName=debug"
            ).replace("State=UP\n", "State=UP PriorityTier=1 GraceTime=30\n") + (
                "PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 "
                "PreemptMode=OFF\n")
        with open(self.path("slurm.conf"), "w") as f:
            f.write(conf)

    def start_munge(self) -> None:
        subprocess.run(["munged", "--force", "-S", self.path("munge", "sock"),
                        f"--key-file={self.path('munge.key')}",
                        f"--log-file={self.path('log', 'munged.log')}",
                        f"--pid-file={self.path('munge', 'pid')}",
                        f"--seed-file={self.path('munge', 'seed')}"], check=True, env=self.env)
        self.pidfiles.append(self.path("munge", "pid"))

    def start(self) -> "Cluster":
        self._write_config()
        self.start_munge()
        subprocess.run(["slurmctld", "-i"], check=True, env=self.env)
        self.pidfiles.append(self.path("slurmctld.pid"))
        subprocess.run(["slurmd"], check=True, env=self.env)
        self.pidfiles.append(self.path("slurmd.pid"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = self.run(["sinfo", "-h", "-o", "%T"], check=False).stdout.strip()
            if out == "idle":
                return self
            time.sleep(0.5)
        raise RuntimeError(f"the SLURM node never became idle (sinfo: {out!r}); logs in "
                           f"{self.path('log')}:\n{self.logs()}")

    def logs(self) -> str:
        text = []
        for name in sorted(os.listdir(self.path("log"))):
            with open(self.path("log", name)) as f:
                text.append(f"== {name}\n" + "".join(f.readlines()[-30:]))
        return "\n".join(text)

    def run(self, cmd, check=True, **kw) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**self.env, **kw.pop("env", {})},
                              **kw)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")
        return proc

    def sbatch(self, *args, env=None) -> str:
        out = self.run(["sbatch", "--parsable", *args], env=env or {}).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> dict:
        out = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait(self, job_id: str, timeout: float = 300, states=("COMPLETED", "FAILED",
             "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info["JobState"] in states:
                return info
            time.sleep(0.2)
        self.run(["scancel", job_id], check=False)
        raise AssertionError(f"job {job_id} still {info['JobState']} after {timeout} s\n"
                             f"{self.logs()}")

    def skip_requeue_hold(self, job_id: str, timeout: float = 180) -> None:
        """SLURM holds a requeued job for ~2 minutes (Reason=BeginTime); the tests do not wait."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info["Restarts"] != "0" and info["JobState"] == "PENDING":
                # first let the previous run's step daemons finish cleaning up (same step ids)
                node = self.run(["sinfo", "-h", "-o", "%T"]).stdout.strip()
                if node == "idle" and not self.processes("slurmstepd"):
                    # slurmd refuses a launch whose credential is not newer (in whole
                    # seconds) than the killed run's revocation: let the clock move on
                    time.sleep(3)
                    self.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])
                    return
            if info["Restarts"] != "0" and info["JobState"] not in ("PENDING", "COMPLETING",
                                                                    "REQUEUED"):
                return  # already running again (not the requeue's own passing states)
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} was not requeued within {timeout} s\n{self.logs()}")

    def stop(self) -> None:
        self.run(["scancel", "--full", "--user=root"], check=False)
        for pidfile in reversed(self.pidfiles):  # slurmd, slurmctld, munged
            try:
                pid = int(open(pidfile).read().strip())
            except (OSError, ValueError):
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
        for pid in self.processes():  # step daemons of jobs killed on the way down
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def processes(self, *names) -> list:
        """PIDs of this cluster's daemons and step daemons (their environment names our
        slurm.conf, or their command line our directory), optionally only ``names``."""
        mine = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/comm") as f:
                    name = f.read().strip()
                if name not in (names or DAEMONS + ("slurmstepd",)):
                    continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if self.dir.encode() in environ + cmdline:
                mine.append(int(pid))
        return mine
