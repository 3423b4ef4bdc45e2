"""Test-only (tests/test_startup_loss.py copies this file, with a kill.json beside it, into a
folder that it puts on the ranks' PYTHONPATH): one rank of the job dies by SIGKILL at a chosen
point of its start-up, as a node failure or the OOM killer would end it, or stops there for
good ("hang"). Python imports ``sitecustomize`` as the interpreter starts, before the module it
runs; production code knows nothing of it.

kill.json: {"rank": 2, "at": POINT, "hang": false}, POINT one of
  "start"          the interpreter's start (before any mpilearn code)
  "import mpi4py"  as ``mpi4py.MPI`` is imported, before MPI_Init
  "mpi init"       inside MPI_Init, once the rank's PMIx client has connected to the launcher
                   (a new socket: a helper process watches the rank's descriptors)
  "open NAME"      as the rank opens a file named NAME (the config: before it is read)
  "rename NAME"    as the rank renames a file into NAME (an atomic write's last step)
Only the first launch's rank dies ("killed" is created beside this file: a relaunch runs on);
the time it died is written into "killed" (seconds since the epoch).
"""
import json
import os
import signal
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))


def _first_time():
    try:
        fd = os.open(os.path.join(_HERE, "killed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return None
    return fd


def _end(fd, pid=None, hang=False):
    os.write(fd, f"{time.time():.3f}\n".encode())
    os.close(fd)
    if hang:
        while True:
            time.sleep(3600)
    os.kill(pid or os.getpid(), signal.SIGKILL)


def _sockets(pid):
    try:
        return {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")}
    except OSError:
        return set()


def _kill_when_connected(fd, pid):
    """In a forked helper: SIGKILL ``pid`` once it opens a socket it did not have."""
    before = _sockets(pid)
    while os.getppid() == pid:
        if _sockets(pid) - before:
            _end(fd, pid)
            break
        time.sleep(0.0005)
    os._exit(0)


def _install(spec, fd):
    at, hang = spec["at"], spec.get("hang", False)
    if at == "start":
        _end(fd, hang=hang)
    if at.startswith(("open ", "rename ")):
        kind, name = at.split(" ", 1)
        event_name, arg = {"open": ("open", 0), "rename": ("os.rename", 1)}[kind]

        def hook(event, args):
            if event == event_name and isinstance(args[arg], str) and \
                    os.path.basename(args[arg]) == name:
                _end(fd, hang=hang)

        sys.addaudithook(hook)
        return

    class Finder:
        def find_spec(self, fullname, path=None, target=None):
            if fullname == "mpi4py.MPI":
                if at == "import mpi4py":
                    _end(fd, hang=hang)
                elif at == "mpi init":
                    sys.meta_path.remove(self)
                    parent = os.getpid()
                    if os.fork() == 0:
                        _kill_when_connected(fd, parent)
                    os.close(fd)
            return None

    sys.meta_path.insert(0, Finder())


def _main():
    try:
        with open(os.path.join(_HERE, "kill.json")) as f:
            spec = json.load(f)
    except OSError:
        return
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK"))
    if rank != str(spec["rank"]) or "OMPI_PARENT_PORT" in os.environ:
        return
    fd = _first_time()
    if fd is not None:
        _install(spec, fd)


_main()
