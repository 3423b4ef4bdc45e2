"""A two-node SLURM cluster on one machine, for the code paths that differ across nodes.

Each node is a network namespace (``ip netns``) with its own address on a bridge and, in
its own UTS and mount namespaces, its own host name and ``/etc/hosts``; a slurmd runs in each
(``slurmd -N``), slurmctld and munged in the root namespace (the munge socket is a file, so
every namespace reaches it). The file system is shared, as on a cluster. Needs root.
"""
from __future__ import annotations

import os
import subprocess

from slurm_cluster import Cluster

PREFIX = "mlt"                # namespaces mlt1, mlt2; bridge mltbr0
NET = "10.231.0"              # nodes .1, .2; the controller (root namespace) .254
NODES = ("mltn1", "mltn2")


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class TwoNodes(Cluster):
    def __init__(self, cpus: int = 4):
        super().__init__(cpus)
        self.host = "vm-ctl"

    def node_ns(self, i: int) -> str:
        return f"{PREFIX}{i + 1}"

    def _network(self) -> None:
        self._teardown_network()
        bridge = f"{PREFIX}br0"
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{NET}.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i in range(len(NODES)):
            ns, host, peer = self.node_ns(i), f"{PREFIX}{i + 1}h", f"{PREFIX}{i + 1}c"
            _ip("netns", "add", ns)
            _ip("link", "add", host, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", ns)
            _ip("link", "set", host, "master", bridge)
            _ip("link", "set", host, "up")
            _ip("netns", "exec", ns, "ip", "addr", "add", f"{NET}.{i + 1}/24", "dev", peer)
            _ip("netns", "exec", ns, "ip", "link", "set", peer, "up")
            _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        with open(self.path("hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n" + "".join(
                f"{NET}.{i + 1} {name}\n" for i, name in enumerate(NODES)) +
                f"{NET}.254 {self.host}\n")

    def _teardown_network(self) -> None:
        for i in range(len(NODES)):
            _ip("netns", "del", self.node_ns(i), check=False)
            _ip("link", "del", f"{PREFIX}{i + 1}h", check=False)
        _ip("link", "del", f"{PREFIX}br0", check=False)

    def _write_config(self) -> None:
        super()._write_config()
        with open(self.path("slurm.conf")) as f:
            lines = f.read().splitlines()
        conf = []
        for line in lines:
            key = line.split("=", 1)[0]
            if key == "SlurmctldHost":
                line = f"SlurmctldHost={self.host}({NET}.254)"
            elif key in ("SlurmdPidFile", "SlurmdLogFile", "SlurmdSpoolDir"):
                line = line + "-%n"
            elif key == "NodeName":
                line = "\n".join(
                    f"NodeName={name} NodeAddr={NET}.{i + 1} NodeHostname={name} "
                    f"CPUs={self.cpus} RealMemory=8000 State=UNKNOWN"
                    for i, name in enumerate(NODES))
            conf.append(line)
        with open(self.path("slurm.conf"), "w") as f:
            f.write("\n".join(conf) + "\n")
        # the PMIx plugin's per-step directory has no node in its name: each node gets its own
        # (a per-node directory mounted over nodetmp in that node's mount namespace)
        os.makedirs(self.path("nodetmp"), exist_ok=True)
        with open(self.path("mpi.conf"), "w") as f:
            f.write(f"PMIxCliTmpDirBase={self.path('nodetmp')}\n")

    def start(self) -> "TwoNodes":
        self._network()
        self._write_config()
        self.start_munge()
        # slurmctld checks that SlurmctldHost names this machine
        subprocess.run(["unshare", "--uts", "sh", "-c",
                        f"hostname {self.host} && exec slurmctld -i"], check=True, env=self.env)
        self.pidfiles.append(self.path("slurmctld.pid"))
        for i, name in enumerate(NODES):
            os.makedirs(self.path(f"spool-{name}"), exist_ok=True)
            os.makedirs(self.path(f"tmp-{name}"), exist_ok=True)
            script = (f"mount --bind {self.path('hosts')} /etc/hosts && "
                      f"mount --bind {self.path(f'tmp-{name}')} {self.path('nodetmp')} && "
                      f"hostname {name} && exec slurmd -N {name}")
            # nsenter, not `ip netns exec`: that mounts a fresh /sys without the cgroup tree
            subprocess.run(["nsenter", f"--net=/run/netns/{self.node_ns(i)}", "unshare", "--uts",
                            "--mount", "sh", "-c", script], check=True, env=self.env)
            self.pidfiles.append(self.path(f"slurmd.pid-{name}"))
        self.wait_idle(len(NODES))
        return self

    def wait_idle(self, n: int, timeout: float = 60) -> None:
        import time

        deadline = time.monotonic() + timeout
        out = ""
        while time.monotonic() < deadline:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout
            if out.count("idle") == n:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the two nodes never became idle (sinfo: {out!r}):\n{self.logs()}")

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self._teardown_network()
