"""Horovod's own example scripts, from Horovod's checkout (never copied into this repository),
run with only their import changed, and a real ``kill -9`` of one rank from outside."""
import os
import re
import signal
import subprocess
import sys

import psutil

CHECKOUT = os.environ.get("HOROVOD_SRC") or os.path.join(
    os.environ.get("MPILEARN_CACHE") or os.path.expanduser("~/.cache/mpilearn"), "horovod", "src")
IMPORTS = {"horovod.torch": "mpilearn.torch", "horovod.tensorflow": "mpilearn.tensorflow",
           "horovod.tensorflow.keras": "mpilearn.tensorflow.keras"}


def example(relpath: str, folder) -> str:
    """Horovod's ``examples/<relpath>`` with ``import horovod.X as hvd`` naming mpilearn's
    drop-in (the one line changed), written into ``folder``."""
    source = open(os.path.join(CHECKOUT, "examples", relpath)).read()
    changed, n = re.subn(r"^import (horovod[\w.]*) as hvd$",
                         lambda m: f"import {IMPORTS[m.group(1)]} as hvd", source, flags=re.M)
    assert n == 1, f"{relpath}: expected one `import horovod... as hvd` line, found {n}"
    path = os.path.join(str(folder), os.path.basename(relpath))
    open(path, "w").write(changed)
    return path


def rank_process(launcher: psutil.Process, rank: int, script: str) -> psutil.Process:
    for proc in launcher.children(recursive=True):
        try:
            if (script in " ".join(proc.cmdline()) and
                    proc.environ().get("OMPI_COMM_WORLD_RANK") == str(rank)):
                return proc
        except psutil.Error:
            continue
    raise AssertionError(f"no process of rank {rank} running {script}")


def run_and_kill(argv, script, env, victim: int, when: str, timeout: float):
    """``argv`` (a launcher command) run to its end; the process of world rank ``victim`` gets
    SIGKILL once a line of the output starts with ``when``. Returns (status, output)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines, killed = [], False
    try:
        for line in proc.stdout:
            lines.append(line)
            if not killed and line.startswith(when):
                os.kill(rank_process(psutil.Process(proc.pid), victim, script).pid,
                        signal.SIGKILL)
                killed = True
        status = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed, "".join(lines)[-3000:]
    return status, "".join(lines)


def launcher(np_, min_np, script, *args):
    return [sys.executable, "-m", "mpilearn.run", "-np", str(np_), "--min-np", str(min_np),
            sys.executable, script, *args]
