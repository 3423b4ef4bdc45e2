"""``mpilearn-run``: a ``horovodrun``-style entry point that builds the MPI launch command.

    mpilearn-run -np 4 -H host1:2,host2:2 python train.py
    mpilearn-run -np 8 --hostfile hosts.txt python -m mpilearn.train --config run.yaml

It prints the ``mpirun`` (Open MPI or MPICH/Intel Hydra) or ``srun`` command, then runs it
(``--dry-run``: only prints). Inside a SLURM allocation with no host list it uses ``srun``.
A hostfile has one host per line as ``host slots=N`` (Horovod and Open MPI) or ``host:N``.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shlex
import shutil
import subprocess
import sys
from typing import List, Optional, Tuple

from ..core.startup import DEFAULT_START_TIMEOUT, START_TIMEOUT_ENV
from .discovery import Growth, discover_hosts, parse_hosts
from .discovery import answer_path, note as discovery_note

FORWARDED = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH")
FORWARDED_PREFIXES = ("MPILEARN_", "OMP_", "NCCL_", "CUDA_", "HOROVOD_", "KERAS_", "TF_")


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
        prog="mpilearn-run", description="Launch a command on N MPI ranks, like horovodrun. "
        "With Open MPI it first removes the session directories ($TMPDIR/ompi.PID) of launchers "
        "that were killed: one whose pid comes round again stops mpirun before any rank runs "
        "(\"The PMIx server's listener thread failed to start\", exit 213).")
    parser.add_argument("-np", "--num-proc", dest="np", type=int, required=True,
                        help="ranks to start (one per GPU; horovodrun's -np)")
    parser.add_argument("-H", "--hosts", default=None,
                        help="host1:slots,host2:slots (default: this machine)")
    parser.add_argument("--hostfile", "-hostfile", default=None,
                        help="a file of hosts, one 'host slots=N' (or host:N) a line")
    parser.add_argument("--launcher", choices=("auto", "mpirun", "srun"), default="auto",
                        help="auto: srun inside a SLURM job given no hosts, else mpirun")
    parser.add_argument("--mpi-args", default="", help="extra arguments for mpirun/srun")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    parser.add_argument("--gloo", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--verbose", action="store_true",
                        help="accepted for horovodrun's scripts; prints nothing more")
    parser.add_argument("-p", "--ssh-port", type=int, default=None,
                        help="the port of sshd on the other hosts (mpirun's rsh agent)")
    parser.add_argument("--start-timeout", type=float, default=None, metavar="SECONDS",
                        help="the bound on a rank's start-up wait under ULFM (--min-np with "
                             "Open MPI 5): a rank whose MPI initialisation has not ended this "
                             "long after it started ends the job, which a lost rank (a kill, "
                             "a failed node) would otherwise leave waiting there for ever; "
                             "exit 75, relaunched with --min-np. The ranks read it as "
                             f"{START_TIMEOUT_ENV}; default {DEFAULT_START_TIMEOUT:g}, 0: none. "
                             "A rank lost on this machine ends the job at once")
    # elastic training, with horovodrun's flag names (README "Elastic training")
    parser.add_argument("--min-np", type=int, default=None,
                        help="elastic: go on with at least this many ranks")
    parser.add_argument("--max-np", type=int, default=None, help="elastic: at most this many")
    parser.add_argument("--max-restarts", type=int, default=3,
                        help="relaunches after a crash (relaunch mode) or after ranks lost "
                             "during start-up (ULFM mode); default 3")
    parser.add_argument("--host-discovery-script", default=None,
                        help="prints the available hosts, one host:slots a line")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="what every rank runs, e.g. python -m mpilearn.train --config c.yaml")
    args = parser.parse_args(argv)
    if args.gloo:
        parser.error("--gloo: mpilearn runs on MPI only")
    try:
        if sum(map(bool, (args.hosts, args.hostfile, args.host_discovery_script))) > 1:
            raise ValueError("give one of -H/--hosts, --hostfile, --host-discovery-script")
        check_elastic(args)
        hosts = (parse_hosts(args.hosts) if args.hosts else
                 read_hostfile(args.hostfile) if args.hostfile else
                 discover_hosts(args.host_discovery_script) if args.host_discovery_script
                 else None)
        extra = args.mpi_args
        if args.ssh_port:
            extra += f" --mca plm_rsh_args '-p {args.ssh_port}'"
        mode, env = None, os.environ
        if args.start_timeout is not None:
            if args.start_timeout < 0:
                raise ValueError(f"--start-timeout must be 0 (no bound) or more seconds, not "
                                 f"{args.start_timeout:g}")
            env = {**env, START_TIMEOUT_ENV: f"{args.start_timeout:g}"}
        if args.min_np is not None:
            mode = elastic_mode(args.launcher, env)
            env = {**env, **elastic_env(args), MODE_ENV: mode}  # a sweep reads the mode
            if mode == "ulfm" and "with-ft" not in extra:
                extra += " --with-ft ulfm"
        cmd = build_command(args.np, hosts, args.command, args.launcher, extra, env)

        def rebuild(np_, hosts_):  # a relaunch on fewer hosts
            return build_command(np_, hosts_, args.command, args.launcher, extra, env)
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
    os.environ.update(env)  # the ranks inherit the elastic bounds
    growth = None
    if mode is not None and args.host_discovery_script:
        growth = Growth(args.host_discovery_script, args.np, args.max_np)
    here = all_here(hosts, args.launcher, env)  # (the first hosts; a growth's may be elsewhere)
    return grow_loop(cmd, args.np, growth, rebuild, lambda cmd_, np_, hosts_: (
        relaunch(cmd_, cmd_[0] == "mpirun" and "-np" in cmd_, np_, args.max_restarts, hosts_,
                 args.min_np, rebuild, growth) if mode == "relaunch" else
        ulfm_relaunch(cmd_, cmd_[0] == "mpirun" and "-np" in cmd_, np_, args.max_restarts,
                      growth, here and hosts_ is hosts) if mode == "ulfm" else
        launch(cmd_, cmd_[0] == "mpirun" and "-np" in cmd_, np_, growth=growth,
               here=here and hosts_ is hosts)), hosts)


# where a launcher finds its hosts without -H or a hostfile (resource managers, a site's default
# hostfile): then its ranks may run elsewhere
ALLOCATION_VARIABLES = ("SLURM_JOB_ID", "PBS_NODEFILE", "LSB_JOBID", "PE_HOSTFILE",
                        "OMPI_MCA_orte_default_hostfile", "PRTE_MCA_prte_default_hostfile",
                        "OMPI_MCA_rmaps_default_hostfile")


def all_here(hosts, launcher: str, env=os.environ) -> bool:
    """Whether the launcher starts every rank on this machine (no host list but this one's,
    no allocation to read one from): ``launch`` then knows that a rank it never saw died."""
    import socket

    if launcher == "srun" or any(name in env for name in ALLOCATION_VARIABLES):
        return False
    here = {"localhost", "127.0.0.1", socket.gethostname(), socket.gethostname().split(".")[0]}
    return all(host in here for host, _ in hosts or ())


def grow_loop(cmd, ranks, growth, rebuild, run_once, hosts=None) -> int:
    """The job, and again at a larger size each time the discovery script offers more slots
    (``growth``; the ranks stopped at a step boundary with a checkpoint, status 75)."""
    while True:
        rc = run_once(cmd, ranks, hosts)
        if growth is None or growth.target is None or growth.interrupted or rc != 75:
            return rc
        old, (ranks, hosts) = ranks, growth.target
        growth.ranks = ranks
        growth.started()
        cmd = with_resume(rebuild(ranks, hosts))
        sys.stderr.write(f"mpilearn-run: growing from {old} to {ranks} ranks on "
                         f"{','.join(f'{h}:{n}' for h, n in hosts)} (the host discovery script); "
                         "relaunching from the checkpoint of the stop\n")
        sys.stderr.flush()


def with_resume(cmd: List[str], output: Optional[str] = None) -> List[str]:
    """An mpilearn.train command that continues from the newest checkpoint (in ``output``, the
    run directory the job recorded, where the command does not name one: a config without
    ``output`` gets a new default directory each time)."""
    if "mpilearn.train" in cmd and "--resume" not in cmd:
        cmd = cmd + ["--resume", "auto"]
        if output and "--output" not in cmd:
            cmd += ["--output", output]
    return cmd


def recorded_output(path: str) -> Optional[str]:
    """The run directory rank 0 recorded in the job's status file (``output DIR``), or None."""
    try:
        with open(path) as f:
            dirs = [line.split(" ", 1)[1].strip() for line in f if line.startswith("output ")]
    except OSError:
        return None
    return dirs[-1] if dirs else None


def check_elastic(args) -> None:
    """horovodrun's rules: min <= np <= max; restarts >= 0."""
    if args.min_np is None:
        if args.max_np is not None:
            raise ValueError("--max-np needs --min-np (an elastic run)")
        return
    if not 1 <= args.min_np <= args.np:
        raise ValueError(f"--min-np {args.min_np} must be between 1 and -np {args.np}")
    if args.max_np is not None and args.max_np < args.np:
        raise ValueError(f"--max-np {args.max_np} is below -np {args.np}")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be at least 0, not {args.max_restarts}")


MODE_ENV = "MPILEARN_ELASTIC_MODE"  # ulfm | relaunch: overrides the launcher's default


def elastic_mode(launcher: str, env=os.environ) -> str:
    """"ulfm" (in-process recovery) where the launcher is Open MPI 5's mpirun, which has
    ``--with-ft ulfm``; "relaunch" (from the newest checkpoint) under srun, MPICH, Intel MPI."""
    if env.get(MODE_ENV) in ("ulfm", "relaunch"):
        return env[MODE_ENV]
    if launcher == "srun" or (launcher == "auto" and "SLURM_JOB_ID" in env):
        return "relaunch"
    return "ulfm" if mpi_flavour("mpirun") == "openmpi" else "relaunch"


def elastic_env(args) -> dict:
    """The bounds the ranks read as train.elastic.min_ranks / max_ranks (config.py)."""
    out = {"MPILEARN_ELASTIC_MIN_RANKS": str(args.min_np)}
    if args.max_np is not None:
        out["MPILEARN_ELASTIC_MAX_RANKS"] = str(args.max_np)
    return out


# exits that a relaunch cannot help: success, bad input, a stop signal (checkpointed)
NOT_RETRIED = (0, 2, 75)


def relaunch(cmd: List[str], open_mpi: bool, ranks: int, restarts: int,
             hosts: Optional[List[Tuple[str, int]]] = None, min_ranks: int = 1,
             rebuild=None, growth: Optional[Growth] = None) -> int:
    """Relaunch mode: a job that crashed runs again from its newest checkpoint (``--resume
    auto`` is added to an mpilearn.train command that has no ``--resume``), up to
    ``restarts`` times; success, bad input (2) and a stop signal (75) are final. A host on
    which ranks aborted in two launches is left out (``hosts`` given: ``rebuild(np, hosts)``
    makes the command), with fewer ranks where its slots are missing, down to ``min_ranks``."""
    failures: collections.Counter = collections.Counter()
    aborted: list = []
    rc = launch(cmd, open_mpi, ranks, aborted, growth)
    for attempt in range(1, restarts + 1):
        if rc in NOT_RETRIED:
            return rc
        for host in {a[2].split(".")[0] for a in aborted if len(a) > 2}:
            failures[host] += 1
        bad = [h for h, _ in hosts or () if failures[h.split(".")[0]] >= 2]
        if bad and rebuild is not None:
            hosts = [(h, n) for h, n in hosts if h not in bad]
            ranks = min(ranks, sum(n for _, n in hosts))
            sys.stderr.write(f"mpilearn-run: leaving out {', '.join(bad)} (ranks there failed "
                             f"twice); {ranks} rank(s) on the others\n")
            if ranks < min_ranks:
                sys.stderr.write(f"mpilearn-run: fewer than --min-np {min_ranks} ranks left; "
                                 "giving up\n")
                return rc
            cmd = rebuild(ranks, hosts)
        cmd = with_resume(cmd)
        sys.stderr.write(f"mpilearn-run: the job failed (exit {rc}); relaunching from the "
                         f"newest checkpoint (restart {attempt} of {restarts})\n")
        sys.stderr.flush()
        aborted = []
        if growth is not None:
            growth.started()
        rc = launch(cmd, open_mpi, ranks, aborted, growth)
    if rc not in NOT_RETRIED:
        sys.stderr.write(f"mpilearn-run: the job failed (exit {rc}) after {restarts} "
                         "restart(s); giving up\n")
    return rc


def relaunches_asked(path: str) -> List[str]:
    """The reasons of every ``relaunch`` line in the job's status file."""
    try:
        with open(path) as f:
            return [line.split(" ", 1)[1].strip() for line in f if line.startswith("relaunch ")]
    except OSError:
        return []


def ulfm_relaunch(cmd: List[str], open_mpi: bool, ranks: int, restarts: int,
                  growth: Optional[Growth] = None, here: bool = False) -> int:
    """ULFM mode: the survivors of a loss go on in the job, but ranks lost during start-up
    (before the in-memory cover begins) end it with 75 and a ``relaunch`` note; such a job runs
    again with ``--resume auto`` in the run directory it recorded (or, lost before it chose
    one, as it was), up to ``restarts`` times. Any other status is final (a stop signal's or a
    below-``min_ranks`` 75 included)."""
    for attempt in range(1, restarts + 2):
        notes: List[str] = []
        dirs: List[str] = []
        rc = launch(cmd, open_mpi, ranks, growth=growth, relaunch_notes=notes, here=here,
                    run_dirs=dirs)
        if rc != 75 or not notes or attempt > restarts:
            return rc
        # lost before the run directory was chosen: nothing was written, the same command
        # again; after: resume there
        how = "as it was (nothing was written yet)"
        if dirs or "--resume" in cmd:
            cmd, how = with_resume(cmd, dirs[-1] if dirs else None), "with --resume auto"
        sys.stderr.write(f"mpilearn-run: the job {notes[0]}, exit 75; relaunching it {how} "
                         f"(restart {attempt} of {restarts})\n")
        sys.stderr.flush()
        if growth is not None:
            growth.started()
    return rc


def aborted_ranks(path: str) -> List[tuple]:
    """(rank, code, host[, reason]) of every rank that recorded an abort in the job's status
    file."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 2 and fields[0].isdigit() and fields[1].lstrip("-").isdigit():
                    reason = " ".join(fields[3:])
                    out.append((int(fields[0]), int(fields[1]), *fields[2:3],
                                *((reason,) if reason else ())))
    except OSError:
        pass
    return out


def ended_status(path: str) -> Optional[int]:
    """The status rank 0 of an elastic job recorded (``end CODE``), or None."""
    try:
        with open(path) as f:
            ends = [line.split()[1] for line in f if line.startswith("end ")]
    except OSError:
        return None
    return int(ends[-1]) if ends and ends[-1].lstrip("-").isdigit() else None


def honest_status(rc: int, aborted: List[Tuple[int, int]]) -> int:
    """The job's exit status: never 0 when a rank aborted, whatever the launcher said."""
    if aborted and rc == 0:
        return next((a[1] for a in aborted if a[1]), 1)
    return rc


READY_WAIT = 10.0  # seconds a stop signal waits for ranks not yet seen listening
# seconds the launcher may go on after a rank recorded an abort: Open MPI 5 with --with-ft ulfm
# was seen to hang for good once every rank had called MPI_Abort (and to ignore SIGTERM)
ABORT_GRACE = float(os.environ.get("MPILEARN_ABORT_GRACE", "10"))
# seconds the launcher may go on after rank 0 of an elastic job recorded its end (everything is
# written by then): a grown job whose rank crashed in MPI_Finalize (Open MPI 5.0 with
# --with-ft ulfm, SIGSEGV) left the others waiting there for good
END_GRACE = float(os.environ.get("MPILEARN_END_GRACE", "60"))


def _ended_with_this_process() -> None:
    """In the launcher's child, before it runs: a SIGTERM when mpilearn-run dies, a kill -9
    included, which no handler sees (Linux's parent-death signal): mpirun and its ranks, in
    their own process group, would otherwise train on with nobody to report to."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: as before
        pass


def launch(cmd: List[str], open_mpi: bool, ranks: int = 1, aborted: Optional[list] = None,
           growth: Optional[Growth] = None, relaunch_notes: Optional[list] = None,
           here: bool = False, run_dirs: Optional[list] = None) -> int:
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
    that a forwarded SIGUSR1 killed anyway ends with one line and status 75 here.

    Ranks that abort record it in a status file (``comm.record_abort``; appended to
    ``aborted`` as (rank, code, host)): the status is then never 0. A job whose 75 asks to be
    run again says why there (``comm.record_relaunch``; appended to ``relaunch_notes``), and
    rank 0 names the run directory (``comm.record_output``; appended to ``run_dirs``).

    ``growth`` (an elastic job with a discovery script) is polled once the ranks listen; when
    it offers more slots the job is asked to grow as by a stop signal, its reason and target
    in the note: the ranks grow in process and answer there, or stop (75) to be relaunched.

    Start-up (``cluster/startwatch.py``, ``core/startup.py``): the ranks on this machine are
    watched (all of them when ``here``: no other host). Under ULFM a rank lost before the
    others could notice it (in ``MPI_Init`` they wait for it for ever) ends the job
    :data:`startwatch.LOSS_GRACE` seconds later, with one line naming the rank and the phase
    it was in, exit 75 and a ``relaunch`` note. A stop signal that finds ranks of this machine
    still starting (in ``MPI_Init`` a rank cannot act on it) ends the job
    :data:`START_STOP_GRACE` seconds after it came: nothing is saved yet, exit 75."""
    import glob
    import signal
    import tempfile
    import time

    from ..core import startup
    from ..core.comm import STATUS_ENV
    from . import cause, sessiondir
    from .preempt import NOTE_ENV, REQUEUE_EXIT
    from .startwatch import StartWatch, descendants, host as this_host

    fd, note = tempfile.mkstemp(prefix="mpilearn-run-", suffix=".signal")
    os.close(fd)
    fd, status = tempfile.mkstemp(prefix="mpilearn-run-", suffix=".status")
    os.close(fd)
    if open_mpi:  # the files' variables must be on the ranks: ``-x`` them (the others pass env)
        cmd = cmd[:1] + ["-x", NOTE_ENV, "-x", STATUS_ENV] + cmd[1:]
        # a killed launcher's session, whose pid this one may get, would stop it (exit 213)
        sessiondir.remove_left_behind()
    env = {**os.environ, NOTE_ENV: note, STATUS_ENV: status}
    # a background process group must not read the terminal (SIGTTIN would stop it)
    stdin = subprocess.DEVNULL if sys.stdin is not None and sys.stdin.isatty() else None
    # the launcher's stderr passes through a scanner: its report of the first failed rank
    read_end, write_end = os.pipe()
    oom_before = cause.oom_kills()
    try:
        child = subprocess.Popen(cmd, env=env, stdin=stdin, stderr=write_end,
                                 start_new_session=True, preexec_fn=_ended_with_this_process)
    finally:
        os.close(write_end)
    scanner = cause.Scanner(read_end)
    watch = StartWatch(child.pid, status, ranks if here else 0)
    ulfm = any(c.startswith("--with-ft") for c in cmd)
    seen = []
    held = []  # the time the first signal came, until it is forwarded
    came = []  # the time the first signal came

    def forward(signum, frame):
        seen.append(signum)
        if len(seen) == 1:
            came.append(time.monotonic())
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
    aborted_at, killed, ended_here = None, False, None
    status_size, end_code, ended_at, stuck_after_end = 0, None, 0.0, False

    def end_job(line: str) -> None:
        """Ends the job from here: this machine's ranks (each in its own process group: a
        rank waiting in MPI_Init would outlive its launcher; so would a rank the job spawned,
        seen as the launcher's descendant), then the launcher (its daemons elsewhere end their
        ranks when it is gone)."""
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        for pid in set(watch.local_pids()) | set(descendants(child.pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except OSError:
            pass
        child.wait()

    try:
        while child.poll() is None:
            watch.poll()
            lost = watch.lost_in_start_up(lambda: [a[0] for a in aborted_ranks(status)]) \
                if ulfm and watch.gone else None
            if lost is not None and not relaunches_asked(status):
                # the survivors wait where they cannot see it (or have not noticed yet)
                rank, where = lost
                reason = f"lost rank {rank} on {this_host()} during start-up ({where})"
                with open(status, "a") as f:
                    f.write(f"relaunch {reason}\n")
                end_job(f"mpilearn-run: {reason}, where the other ranks cannot notice it; "
                        "nothing trained was lost; ending the job (exit 75: run it again with "
                        "--resume auto)")
                ended_here = REQUEUE_EXIT
                break
            starting = watch.starting() if came and \
                time.monotonic() - came[0] > START_STOP_GRACE else []
            if starting:
                who = ", ".join(f"rank {r}: {where}" for r, where in starting)
                end_job(f"mpilearn-run: stopped by {signal.Signals(seen[0]).name} during "
                        f"start-up: {START_STOP_GRACE:g} s later ranks were still starting "
                        f"({who}), and a rank in MPI's initialisation cannot act on a stop; "
                        "nothing saved; ending the job (exit 75: run it again with --resume "
                        "auto)")
                ended_here = REQUEUE_EXIT
                break
            size = os.path.getsize(status)
            if size != status_size:  # read again only once it grew
                status_size = size
                if aborted_at is None and aborted_ranks(status):
                    aborted_at = time.monotonic()
                if end_code is None:
                    end_code, ended_at = ended_status(status), time.monotonic()
            if aborted_at is not None and time.monotonic() - aborted_at > ABORT_GRACE:
                end_job(f"mpilearn-run: a rank aborted and the launcher has not ended the job "
                        f"{ABORT_GRACE:g} s later; killing it")
                killed = True
                break
            if end_code is not None and time.monotonic() - ended_at > END_GRACE:
                who = cause.crashed(scanner.text(wait=0))
                end_job(f"mpilearn-run: the job finished (rank 0's status "
                        f"{end_code}) and its launcher has not exited "
                        f"{END_GRACE:g} s later: ranks stuck in their exit (MPI_Finalize)"
                        f"{' after ' + who if who else ''}; everything was written; ending it")
                stuck_after_end = True
                break
            listening = len(glob.glob(glob.escape(note) + ".*")) >= ranks
            if growth is not None and not seen and not held and listening:
                # grown in process (rank 0 answered in the note), or the ranks are asked to
                # grow at the next step boundary (in process, else stopped and relaunched)
                reason = None if growth.grew(note) else growth.poll()
                if reason:
                    with open(note, "w") as f:
                        f.write(discovery_note(reason, *growth.target))
                    held.append(time.monotonic())
            if held and (listening or time.monotonic() - held[0] > READY_WAIT):
                held.clear()
                child.send_signal(signal.SIGUSR1)
            time.sleep(0.05)
        rc = child.returncode if ended_here is None else ended_here
        if growth is not None:
            growth.interrupted = bool(seen)
        recorded = aborted_ranks(status)
        ended = ended_status(status)
        relaunches_asked_list = relaunches_asked(status)
        if aborted is not None:
            aborted.extend(recorded)
        if relaunch_notes is not None:
            relaunch_notes.extend(relaunches_asked_list)
        if run_dirs is not None and recorded_output(status):
            run_dirs.append(recorded_output(status))
        if recorded:
            who = ", ".join(f"rank {a[0]} (code {a[1]}{' on ' + a[2] if len(a) > 2 else ''}"
                            f"{': ' + a[3] if len(a) > 3 else ''})" for a in recorded)
            sys.stderr.write(f"mpilearn-run: aborted: {who}\n")
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        if open_mpi and child.returncode is not None and child.returncode < 0:
            # killed (here or by anyone): its session is left, for a later launcher to trip on
            sessiondir.remove_left_behind()
        for path in [note, status] + glob.glob(glob.escape(note) + ".*"):
            os.unlink(path)
        if os.path.exists(answer_path(note)):
            os.unlink(answer_path(note))
    rc = 128 - rc if rc < 0 else rc
    if killed:  # the status is the ranks' record, not the SIGKILL's
        rc = 0
    if stuck_after_end:  # the run's own status: it had finished (unless a rank aborted)
        scanner.text()  # the launcher's last words first
        return honest_status(ended, recorded)
    rc = honest_status(rc, recorded)
    if ended_here is not None or (not seen and rc not in (0, REQUEUE_EXIT) and any(
            n.startswith(startup.GAVE_UP) for n in relaunches_asked_list)):
        # ended here (its line said why), or by the ranks' own bound on a start-up that waited
        # in MPI_Init for a lost rank (core/startup.py: status 1, rank 0's line said why):
        # nothing trained was lost, run it again
        scanner.text()  # the launcher's last words come before the relaunch's
        return REQUEUE_EXIT
    if ended is not None and rc > 128 and not recorded and not seen:
        sys.stderr.write(f"mpilearn-run: the launcher exited {rc} (a spawned rank lost, or a "
                         f"refused spawn, which the job survived); the job's own status is "
                         f"{ended}\n")
        return ended
    report = scanner.text()
    # a rank with no handler yet died of it (Open MPI: 128 + 10, Hydra: 10): say it once
    if len(seen) == 1 and rc in (128 + signal.SIGUSR1, signal.SIGUSR1):
        sys.stderr.write(f"mpilearn-run: stopped by {signal.Signals(seen[0]).name} before the "
                         "ranks listened for stop signals; nothing saved\n")
        return REQUEUE_EXIT
    if seen and rc == 0:  # the ranks had finished: the signal had nothing left to stop
        sys.stderr.write(f"mpilearn-run: {signal.Signals(seen[0]).name} came as the job was "
                         "ending; it had finished (status 0)\n")
    # a killed rank: one line naming it (the survivors' SIGTERMs were only the consequence);
    # mpilearn's own statuses already have theirs (a traceback, bad input, the watchdog)
    if not seen and (rc not in KNOWN_EXITS or cause.first_failure(report)):
        sys.stderr.write(cause.describe(report, rc, oom_before, cause.oom_kills(),
                                        during=watch.during, ranks=ranks) + "\n")
    return rc


# seconds a stop signal waits for the ranks of this machine that are still starting before
# mpilearn-run ends the job: under SLURM's KillWait (30 s), the grace a scheduler gives
START_STOP_GRACE = float(os.environ.get("MPILEARN_START_STOP_GRACE", "15"))


# statuses whose cause mpilearn's ranks already named: done, a traceback (1), bad input (2),
# stopped by its guard (3), a failed sweep (4), stopped with the state saved (75), the watchdog
KNOWN_EXITS = (0, 1, 2, 3, 4, 75, 124)


if __name__ == "__main__":
    sys.exit(main())
