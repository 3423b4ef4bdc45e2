"""Ranks, node-local ranks, device binding and abort-on-error.

Nothing here assumes it owns ``COMM_WORLD``: every function takes the communicator it should
use, so the same code runs alone, under ``mpirun``/``srun`` and inside an HPO block.
MPI is initialised by :func:`init`, never on import.
"""
from __future__ import annotations

import os
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Optional


from ..errors import UsageError  # noqa: F401  (re-exported: raised by the checks here)


@dataclass
class Context:
    """Where this process sits: its communicator and its node-local placement."""

    comm: Any
    local_comm: Any
    device: str = "cpu"
    gpus_per_task: Optional[bool] = None  # gpus_are_per_task's answer, once asked

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    @property
    def local_rank(self) -> int:
        return self.local_comm.Get_rank()

    @property
    def local_size(self) -> int:
        return self.local_comm.Get_size()


_CONTEXT: Optional[Context] = None
_HOOK_INSTALLED = False


def mpi():
    """The mpi4py ``MPI`` module, initialised on first use (not on import of mpilearn)."""
    from mpi4py import MPI

    return MPI


def make_context(comm, device: str = "cpu") -> Context:
    """Context for ``comm``; the node-local communicator is a shared-memory split of it."""
    MPI = mpi()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    return Context(comm=comm, local_comm=local, device=device)


def init(comm=None) -> Context:
    """Initialise MPI (works with no launcher: size 1) and install the abort-on-error hook."""
    global _CONTEXT
    if _CONTEXT is not None and (comm is None or comm is _CONTEXT.comm):
        return _CONTEXT
    MPI = mpi()
    _CONTEXT = make_context(comm if comm is not None else MPI.COMM_WORLD)
    install_abort_hook(_CONTEXT.comm)
    return _CONTEXT


def replace_comm(ctx: Context, comm, shrunk: bool = True) -> None:
    """Collective on ``comm``: from now on the job is ``comm`` (the survivors of a lost rank,
    or the ranks with the ones spawned to join them, ``shrunk=False``:
    :mod:`mpilearn.core.membership`); the node-local split and the exit barrier follow it."""
    MPI = mpi()
    ctx.comm = comm
    ctx.local_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    ctx.gpus_per_task = None
    if _EXIT_GUARD:
        _EXIT_GUARD["comm"] = comm.Dup()
        # a grown job without a loss finalizes as usual (mpirun reads a rank that exits
        # without MPI_Finalize as failed when no rank was lost)
        _EXIT_GUARD["shrunk"] = _EXIT_GUARD.get("shrunk", False) or shrunk


def check_launch(ctx: Context) -> str:
    """Checks that MPI agrees with the launcher (UsageError if not); returns a log line."""
    from ..cluster import launcher

    launch = launcher.detect()
    launcher.check(launch, ctx.rank, ctx.size)
    return f"mpilearn: launcher {launch.describe()}; {ctx.local_size} rank(s) on this node"


def context() -> Context:
    if _CONTEXT is None:
        raise RuntimeError("mpilearn.init() has not been called")
    return _CONTEXT


STATUS_ENV = "MPILEARN_STATUS_FILE"


def record_abort(rank: int, code: int, reason: str = "") -> None:
    """Before MPI_Abort: append ``rank code host reason`` to the job's status file
    (``mpilearn-run`` names it in MPILEARN_STATUS_FILE). Under ``mpirun --with-ft ulfm`` an
    aborted job can exit 0, or never end when every rank aborts; the launcher reads this file
    instead of trusting it. ``reason`` (the exception's last line) reaches the launcher's line
    even where the launcher drops the rank's own last output (Hydra kills the job at an abort
    before forwarding it, on a loaded machine)."""
    import socket

    # the host: relaunch leaves it out
    _append_status(f"{rank} {code} {socket.gethostname()} {' '.join(reason.split())}".rstrip()
                   + "\n")


def record_relaunch(reason: str) -> None:
    """``relaunch REASON`` in the job's status file: this job's exit 75 asks ``mpilearn-run`` to
    run it again (ranks lost during start-up), unlike a stop signal's 75, which is final."""
    _append_status("relaunch " + " ".join(reason.split()) + "\n")


def record_phase(rank: int, pid: int, phase: str) -> None:
    """``phase RANK PID WORDS`` in the job's status file: where this rank's start-up is
    (``core/startup.py``); ``mpilearn-run`` names the phase of a rank it saw die."""
    _append_status(f"phase {rank} {pid} {phase}\n")


def record_output(path: str) -> None:
    """``output DIR`` in the job's status file (rank 0, once the run directory is chosen):
    ``mpilearn-run`` relaunches a job that lost a rank in start-up from there, or, where it
    has none, as it was (nothing was written yet)."""
    _append_status(f"output {path}\n")


def exit_without_finalize(code) -> None:
    """Leave now with ``code``, without ``MPI_Finalize``: after a lost rank it may wait for
    the lost one (the exit guard's path after a loss, for a rank that had none yet)."""
    _exit_now(code)


def _append_status(line: str) -> None:
    path = os.environ.get(STATUS_ENV)
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())  # one write: lines of ranks never mix
        finally:
            os.close(fd)
    except OSError:  # a rank on another machine may not see the launcher's file
        pass


def record_end(code: int) -> None:
    """Rank 0 of an elastic job: ``end CODE`` in the status file, the run's own status.
    ``mpirun --with-ft ulfm`` (Open MPI 5.0.11) exits 137 once a rank that the job had spawned
    was killed, although the others survived it and finished (open-mpi/ompi#13325), and 213
    after an ``MPI_Comm_spawn`` it refused, although the ranks then stopped with 75."""
    _append_status(f"end {code}\n")


def abort(world, code: int, reason: str = "") -> None:
    """MPI_Abort with ``code``, recorded for the launcher first (with ``reason``)."""
    record_abort(world.Get_rank(), code, reason)
    world.Abort(code)


def install_abort_hook(comm) -> None:
    """An uncaught exception on any rank prints ``rank R: <traceback>`` and aborts the job.

    Without this, the other ranks would wait forever in their next collective.
    """
    global _HOOK_INSTALLED
    if _HOOK_INSTALLED:
        return
    _HOOK_INSTALLED = True
    world = mpi().COMM_WORLD
    rank = world.Get_rank()

    def report_and_abort(exc_type, exc, tb):
        if issubclass(exc_type, (SystemExit, KeyboardInterrupt)) and world.Get_size() == 1:
            return sys.__excepthook__(exc_type, exc, tb)
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write("".join(f"rank {rank}: {line}\n" for line in text.rstrip().splitlines()))
        sys.stderr.flush()
        if world.Get_size() > 1:
            abort(world, 1, traceback.format_exception_only(exc_type, exc)[-1].strip())
        else:
            os._exit(1)

    def thread_hook(args):
        report_and_abort(args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = report_and_abort
    threading.excepthook = thread_hook
    if world.Get_size() > 1:
        install_exit_guard(world)
        watch_launcher(rank)


LAUNCHER_GONE_EXIT = 143


def watch_launcher(rank: int, every: float = 0.5) -> None:
    """Exit when the launcher that started this rank dies (``kill -9`` of mpirun alone): the
    rank is re-parented, its stdout is gone, and anything it went on to do (a trial failing on
    EIO, a journal line) would be a lie. A thread notices within ``every`` seconds."""
    parent = os.getppid()

    def watch():
        import time

        while True:
            time.sleep(every)
            if os.getppid() != parent:
                try:
                    sys.stderr.write(f"rank {rank}: the launcher (pid {parent}) is gone; "
                                     "exiting\n")
                    sys.stderr.flush()
                except OSError:
                    pass
                os._exit(LAUNCHER_GONE_EXIT)

    if parent > 1:
        threading.Thread(target=watch, name="mpilearn-launcher-watch", daemon=True).start()


_EXIT_GUARD: dict = {}  # the communicator the exit barrier runs on (replace_comm swaps it)
EXIT_WAIT_S = float(os.environ.get("MPILEARN_EXIT_WAIT", "10"))


def install_exit_guard(world) -> None:
    """``sys.exit()`` on one rank while the others still run would hang the job: Python calls
    no excepthook for SystemExit, and the exiting rank would block in MPI_Finalize while the
    others wait for it in a collective. At exit, every rank enters a non-blocking barrier; a
    rank that called ``sys.exit`` and finds the others not there within ``MPILEARN_EXIT_WAIT``
    seconds (10) aborts the job, naming itself and its exit code. A rank that simply reaches the
    end of its script waits as MPI_Finalize would (rank 0 may still be finishing its work)."""
    import atexit
    import time

    _EXIT_GUARD["comm"] = world.Dup()
    rank = world.Get_rank()
    called = {}
    plain_exit = sys.exit

    def recording_exit(code=None):
        called["code"] = code
        plain_exit(code)

    def at_exit():
        request = _EXIT_GUARD["comm"].Ibarrier()
        deadline = time.monotonic() + EXIT_WAIT_S if "code" in called else None
        while not request.Test():
            if deadline is not None and time.monotonic() > deadline:
                code = called["code"]
                sys.stderr.write(f"rank {rank}: exited with sys.exit({code!r}) while other ranks "
                                 "were still running; aborting the job\n")
                sys.stderr.flush()
                abort(world, code if isinstance(code, int) and code > 0 else 1,
                      f"sys.exit({code!r}) while other ranks were still running")
            time.sleep(0.005)
        if _EXIT_GUARD.get("shrunk"):
            # MPI_Finalize after a lost rank hung on loaded machines (ULFM); the SIGALRM that
            # bounded it killed the rank, and `mpirun --with-ft ulfm` reads a rank killed by a
            # signal as exit 0, so a checkpointed "resume me" (75) came out as done. Everything
            # is written by now: leave without MPI_Finalize, with the run's own status.
            _exit_now(called.get("code", _EXIT_GUARD.get("status")))

    sys.exit = recording_exit
    atexit.register(at_exit)


def leaving(status: int) -> int:
    """``status``, recorded as the exit status of this rank's ``main()``: in ``sys.exit(main())``
    Python looks ``sys.exit`` up before ``main()`` installs the guard's, so the guard would not
    see it (the exit after a lost rank needs it, above)."""
    _EXIT_GUARD["status"] = status
    return status


def _exit_now(code) -> None:
    """``os._exit`` with the status ``sys.exit(code)`` would give, after the flushes that the
    interpreter's own teardown would have done."""
    import logging

    if code is not None and not isinstance(code, int):
        sys.stderr.write(f"{code}\n")
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code or 0)


def _poll_asleep(ready) -> None:
    """Call ``ready()`` until it is true, sleeping 0.1 ms growing to 5 ms between calls."""
    import time

    nap = 1e-4
    while not ready():
        time.sleep(nap)
        nap = min(nap * 2, 0.005)


def wait_idle(comm) -> None:
    """Collective: a barrier that the early ranks wait at asleep. MPI's blocking calls spin
    on the core; behind seconds of rank-0-only work (the plan's checks, which import the
    model file's framework: TensorFlow takes 4 s) that spinning took cores that ranks of
    other jobs on a shared CPU node needed."""
    _poll_asleep(comm.Ibarrier().Test)


def recv_idle(comm, source: int, tag: int):
    """``comm.recv``, waiting asleep (as :func:`wait_idle`): a block waits for its next trial
    while rank 0's searcher fits its model."""
    _poll_asleep(lambda: comm.Iprobe(source=source, tag=tag))
    return comm.recv(source=source, tag=tag)


def fail_usage(comm, message: Optional[str]) -> None:
    """Collective: if rank 0 found bad input, every rank raises the same UsageError (the
    ``main()`` prints it once, from rank 0, and every rank exits 2 together)."""
    wait_idle(comm)
    message = comm.bcast(message, root=0)
    if message is not None:
        raise UsageError(message)


def check_on_root(comm, fn, *args, **kwargs):
    """Run ``fn`` on rank 0; a UsageError it raises is raised on every rank.

    Returns fn's result on rank 0 and None elsewhere.
    """
    result, message = None, None
    if comm.Get_rank() == 0:
        try:
            result = fn(*args, **kwargs)
        except UsageError as err:
            message = str(err)
    fail_usage(comm, message)
    return result


def cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def gpus_are_per_task(ctx: Context) -> bool:
    """True when the launcher gave every rank on this node its own GPU set
    (``srun --gpus-per-task``/``--gpu-bind``): CUDA_VISIBLE_DEVICES differs between them.

    Collective on the node the first time only: a sweep's blocks share the node's
    communicator but start their trials at different times, and a block with one trial more
    than the others would wait for ever in a second allgather (the environment does not
    change within a job, so the first answer holds)."""
    if ctx.gpus_per_task is None:
        sets = ctx.local_comm.allgather(os.environ.get("CUDA_VISIBLE_DEVICES"))
        ctx.gpus_per_task = (ctx.local_size > 1 and None not in sets
                             and len(set(sets)) == len(sets))
    return ctx.gpus_per_task


def shared_gpus_from_env() -> bool:
    """``MPILEARN_ALLOW_SHARED_GPUS=1``: device.allow_shared_gpus for every run of a job
    (e.g. a test suite of multi-rank runs on a one-GPU machine)."""
    return os.environ.get("MPILEARN_ALLOW_SHARED_GPUS", "0").lower() in ("1", "true", "yes")


def choose_device(ctx: Context, want: str = "auto", allow_shared_gpus: bool = False,
                  n_gpus: Optional[int] = None, per_task: bool = False,
                  backend: str = "mpi") -> str:
    """One process per GPU: the node-local rank selects ``cuda:local_rank``, or ``cuda:0``
    when the launcher already gave each rank its own GPU (``per_task``).

    More ranks per node than GPUs is an error unless ``allow_shared_gpus``, and always with
    the ``torch`` backend (NCCL refuses two ranks on one GPU); on CPU, torch uses
    cores / ranks-per-node threads so that ranks do not fight over cores.
    """
    n_gpus = cuda_device_count() if n_gpus is None else n_gpus
    if want == "cpu" or (want == "auto" and n_gpus == 0):
        return "cpu"
    if n_gpus == 0:
        raise UsageError(f"device.type is '{want}' but no CUDA device is visible to this rank")
    if per_task:
        return "cuda:0"
    if ctx.local_size > n_gpus and backend == "torch":
        raise UsageError(
            f"{ctx.local_size} ranks on this node but only {n_gpus} GPU(s) visible, and "
            "train.backend=torch uses NCCL, which cannot run two ranks on one GPU: launch one "
            f"rank per GPU (at most {n_gpus} per node), or share GPUs with train.backend=mpi "
            "and device.allow_shared_gpus=true")
    if ctx.local_size > n_gpus and not allow_shared_gpus:
        raise UsageError(
            f"{ctx.local_size} ranks on this node but only {n_gpus} GPU(s) visible: "
            f"launch with at most {n_gpus} tasks per node (srun --ntasks-per-node={n_gpus} / "
            f"mpirun --map-by ppr:{n_gpus}:node) or give each task its GPU "
            f"(--gpus-per-task=1), or set device.allow_shared_gpus=true")
    return f"cuda:{ctx.local_rank % n_gpus}"


def bind(ctx: Context, device: str) -> None:
    """Make ``device`` current and size the CPU thread pool for this rank."""
    import torch

    ctx.device = device
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    torch.set_num_threads(threads_per_rank(ctx))


def threads_per_rank(ctx: Context) -> int:
    """CPU threads for this rank: OMP_NUM_THREADS, else its core set when a launcher bound
    it, else cores / ranks on the node."""
    if os.environ.get("OMP_NUM_THREADS"):
        return int(os.environ["OMP_NUM_THREADS"])
    total = os.cpu_count() or 1
    mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else total
    return mine if mine < total else max(1, total // max(1, ctx.local_size))
