"""``mpilearn-run``: a ``horovodrun``-style entry point that builds the MPI launch command.

    mpilearn-run -np 4 -H host1:2,host2:2 python train.py
    mpilearn-run -np 8 --hostfile hosts.txt python -m mpilearn.train --config run.yaml

It prints the ``mpirun`` (Open MPI or MPICH/Intel Hydra) or ``srun`` command, then runs it
(``--dry-run``: only prints). Inside a SLURM allocation with no host list it uses ``srun``.
A hostfile has one host per line as ``host slots=N`` (Horovod and Open MPI) or ``host:N``.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from typing import List, Optional, Tuple

FORWARDED = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH")
FORWARDED_PREFIXES = ("MPILEARN_", "OMP_", "NCCL_", "CUDA_", "HOROVOD_", "KERAS_", "TF_")


def parse_hosts(spec: str) -> List[Tuple[str, int]]:
    """``host1:2,host2`` -> [("host1", 2), ("host2", 1)]."""
    hosts = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, slots = part.partition(":")
        if slots and not slots.isdigit():
            raise ValueError(f"bad host entry {part!r}: expected host or host:slots")
        hosts.append((name, int(slots or 1)))
    return hosts


def read_hostfile(path: str) -> List[Tuple[str, int]]:
    hosts = []
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            name, slots = fields[0], 1
            for field in fields[1:]:
                if field.startswith("slots="):
                    slots = int(field.split("=", 1)[1])
            if ":" in name:
                name, slots = name.split(":", 1)[0], int(name.split(":", 1)[1])
            hosts.append((name, slots))
    if not hosts:
        raise ValueError(f"hostfile {path} lists no hosts")
    return hosts


def mpi_flavour(mpirun: str) -> str:
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "openmpi"
    return flavour_of(out.stdout + out.stderr)


def flavour_of(version: str) -> str:
    """``mpirun --version``'s text -> "hydra" (MPICH, Intel MPI), "openmpi-orte" (Open MPI 4
    and older: ``orterun``) or "openmpi" (Open MPI 5: PRRTE's ``prterun``)."""
    text = version.lower()
    if "hydra" in text or "mpich" in text or "intel" in text:
        return "hydra"
    major = re.search(r"\(open mpi\) (\d+)\.", text)
    return "openmpi-orte" if major and int(major.group(1)) < 5 else "openmpi"


def build_command(np_: int, hosts: Optional[List[Tuple[str, int]]], command: List[str],
                  launcher: str = "auto", mpi_args: str = "", env=os.environ,
                  flavour: Optional[str] = None) -> List[str]:
    if not command:
        raise ValueError("no command to run (e.g. mpilearn-run -np 2 python train.py)")
    if np_ < 1:
        raise ValueError(f"-np must be at least 1, not {np_}")
    if hosts and sum(s for _, s in hosts) < np_:
        raise ValueError(f"-np {np_} but the hosts offer only {sum(s for _, s in hosts)} slots")
    if launcher == "auto":
        launcher = "srun" if ("SLURM_JOB_ID" in env and not hosts) else "mpirun"
    extra = shlex.split(mpi_args)
    if launcher == "srun":
        return ["srun", f"--ntasks={np_}", "--kill-on-bad-exit=1", *extra, *command]
    flavour = flavour or mpi_flavour("mpirun")
    if flavour == "hydra":
        cmd = ["mpirun", "-n", str(np_)]
        if hosts:
            cmd += ["-hosts", ",".join(f"{h}:{s}" for h, s in hosts)]
        return cmd + ["-genvall", *extra, *command]
    cmd = ["mpirun", "-np", str(np_), "--bind-to", "none", "--map-by", "slot"]
    if flavour == "openmpi-orte":
        # its block after a rank's non-zero exit would follow mpilearn's one message (Open
        # MPI 5 has no such switch: README, "What each launcher adds to mpilearn's message")
        cmd += ["--quiet"]
    if hosts:
        cmd += ["-H", ",".join(f"{h}:{s}" for h, s in hosts)]
    elif np_ > (os.cpu_count() or 1):
        cmd += ["--oversubscribe"]  # more ranks than cores on this one machine
    names = [k for k in env if k in FORWARDED or k.startswith(FORWARDED_PREFIXES)]
    for k in sorted(names):
        cmd += ["-x", k]
    return cmd + [*extra, *command]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="mpilearn-run", description="Launch a command on N MPI ranks, like horovodrun.")
    parser.add_argument("-np", "--num-proc", dest="np", type=int, required=True)
    parser.add_argument("-H", "--hosts", default=None, help="host1:slots,host2:slots")
    parser.add_argument("--hostfile", "-hostfile", default=None)
    parser.add_argument("--launcher", choices=("auto", "mpirun", "srun"), default="auto")
    parser.add_argument("--mpi-args", default="", help="extra arguments for mpirun/srun")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    parser.add_argument("--gloo", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("-p", "--ssh-port", type=int, default=None)
    parser.add_argument("--start-timeout", type=int, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.gloo:
        parser.error("--gloo: mpilearn runs on MPI only")
    try:
        if args.hosts and args.hostfile:
            raise ValueError("give -H/--hosts or --hostfile, not both")
        hosts = (parse_hosts(args.hosts) if args.hosts else
                 read_hostfile(args.hostfile) if args.hostfile else None)
        extra = args.mpi_args
        if args.ssh_port:
            extra += f" --mca plm_rsh_args '-p {args.ssh_port}'"
        cmd = build_command(args.np, hosts, args.command, args.launcher, extra)
    except (ValueError, OSError) as err:
        sys.stderr.write(f"mpilearn-run: error: {err}\n")
        return 2
    line = " ".join(shlex.quote(c) for c in cmd)
    if args.dry_run:
        print(line)
        return 0
    sys.stderr.write(f"mpilearn-run: {line}\n")
    sys.stderr.flush()
    if shutil.which(cmd[0]) is None:
        sys.stderr.write(f"mpilearn-run: error: {cmd[0]} not found on PATH\n")
        return 2
    return launch(cmd, cmd[0] == "mpirun" and "-np" in cmd, args.np)


READY_WAIT = 10.0  # seconds a stop signal waits for ranks not yet seen listening


def launch(cmd: List[str], open_mpi: bool, ranks: int = 1) -> int:
    """Runs the launcher; SIGINT/SIGTERM/SIGHUP to this process (Ctrl-C, ``kill``) reach
    the ranks as a SIGUSR1, which every launcher forwards and none turns into a kill (Open MPI's
    ``mpirun`` SIGKILLs the ranks 0.5 s after a SIGTERM or SIGINT), with the original signal's
    name in a note file: the ranks stop after their current step, checkpoint, say so once and
    exit 75. A second signal ends the job at once. The launcher runs in its own process group,
    so a terminal's Ctrl-C reaches it only through here.

    Start-up: a SIGUSR1 kills a rank that has no handler yet (or one not started yet never
    hears it), so the signal is held until all ``ranks`` have said they listen (each creates
    ``<note>.<pid>``, ``preempt.install``), or ``READY_WAIT`` seconds at most: a rank on
    another machine cannot be seen, and a command that is not mpilearn's never says it. A job
    that a forwarded SIGUSR1 killed anyway ends with one line and status 75 here."""
    import glob
    import signal
    import tempfile
    import time

    from . import cause
    from .preempt import NOTE_ENV, REQUEUE_EXIT

    fd, note = tempfile.mkstemp(prefix="mpilearn-run-", suffix=".signal")
    os.close(fd)
    if open_mpi:  # the note's variable must be on the ranks: ``-x`` it (the others pass env)
        cmd = cmd[:1] + ["-x", NOTE_ENV] + cmd[1:]
    env = {**os.environ, NOTE_ENV: note}
    # a background process group must not read the terminal (SIGTTIN would stop it)
    stdin = subprocess.DEVNULL if sys.stdin is not None and sys.stdin.isatty() else None
    # the launcher's stderr passes through a scanner: its report of the first failed rank
    read_end, write_end = os.pipe()
    oom_before = cause.oom_kills()
    try:
        child = subprocess.Popen(cmd, env=env, stdin=stdin, stderr=write_end,
                                 start_new_session=True)
    finally:
        os.close(write_end)
    scanner = cause.Scanner(read_end)
    seen = []
    held = []  # the time the first signal came, until it is forwarded

    def forward(signum, frame):
        seen.append(signum)
        if len(seen) == 1:
            with open(note, "w") as f:
                f.write(signal.Signals(signum).name + "\n")
            held.append(time.monotonic())
            return
        sys.stderr.write(f"mpilearn-run: {signal.Signals(signum).name} again: ending the job "
                         "now, without a checkpoint\n")
        sys.stderr.flush()
        # Open MPI ends the job on SIGTERM; srun and Hydra on a second SIGINT within 1 s
        for sig in (signal.SIGTERM,) if open_mpi else (signal.SIGINT, signal.SIGINT):
            child.send_signal(sig)

    # SIGHUP too: the launcher's own session no longer hears a closing terminal
    saved = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        while child.poll() is None:
            if held and (len(glob.glob(glob.escape(note) + ".*")) >= ranks
                         or time.monotonic() - held[0] > READY_WAIT):
                held.clear()
                child.send_signal(signal.SIGUSR1)
            time.sleep(0.05)
        rc = child.returncode
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        for path in [note] + glob.glob(glob.escape(note) + ".*"):
            os.unlink(path)
    rc = 128 - rc if rc < 0 else rc
    report = scanner.text()
    # a rank with no handler yet died of it (Open MPI: 128 + 10, Hydra: 10): say it once
    if len(seen) == 1 and rc in (128 + signal.SIGUSR1, signal.SIGUSR1):
        sys.stderr.write(f"mpilearn-run: stopped by {signal.Signals(seen[0]).name} before the "
                         "ranks listened for stop signals; nothing saved\n")
        return REQUEUE_EXIT
    # a killed rank: one line naming it (the survivors' SIGTERMs were only the consequence);
    # mpilearn's own statuses already have theirs (a traceback, bad input, the watchdog)
    if not seen and (rc not in KNOWN_EXITS or cause.first_failure(report)):
        sys.stderr.write(cause.describe(report, rc, oom_before, cause.oom_kills()) + "\n")
    return rc


# statuses whose cause mpilearn's ranks already named: done, a traceback (1), bad input (2),
# stopped by its guard (3), a failed sweep (4), stopped with the state saved (75), the watchdog
KNOWN_EXITS = (0, 1, 2, 3, 4, 75, 124)


if __name__ == "__main__":
    sys.exit(main())
