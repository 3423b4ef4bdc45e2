"""Horovod's own elastic example scripts, from Horovod's checkout (never copied into this
repository), run with only their import changed under ``mpilearn-run -np N --min-np M``, with a
real ``kill -9`` of one rank from outside; exit 0 when every example finished after its kill.

    HOROVOD_SRC=/path/to/horovod python bench/horovod_elastic_examples.py

Needs Horovod's git checkout (its PyPI sdist has no examples/, and the test machines reach only
the package registries, so this is a bench, not a test) and, for its TF2 scripts (Keras 2's
``opt.lr``), ``pip install tf_keras==<the installed TensorFlow's version>``. Horovod's PyTorch
elastic examples import torchvision, which has no build for this torch here: not run.
"""
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


EXAMPLES = [  # (path under examples/, np, min-np, victim, kill after the line, its arguments)
    ("elastic/tensorflow2/tensorflow2_synthetic_benchmark_elastic.py", 2, 1, 1, "Iter #1",
     ["--no-cuda", "--model", "MobileNet", "--batch-size", "2", "--num-warmup-batches", "1",
      "--num-batches-per-iter", "1", "--num-iters", "4"], "Total img/sec on 1 CPU(s)"),
]


def main() -> int:
    import tempfile
    import time

    if not os.path.isdir(os.path.join(CHECKOUT, "examples")):
        print(f"Horovod's checkout is not at {CHECKOUT}: set HOROVOD_SRC", file=sys.stderr)
        return 2
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
    failed = 0
    with tempfile.TemporaryDirectory() as folder:
        for relpath, np_, min_np, victim, when, args, done in EXAMPLES:
            script = example(relpath, folder)
            start = time.monotonic()
            status, out = run_and_kill(launcher(np_, min_np, script, *args), script, env,
                                       victim=victim, when=when, timeout=600)
            ok = status == 0 and out.count(f"hvd.elastic: lost rank {victim} on ") == 1 \
                and done in out
            failed += not ok
            print(f"| {relpath} | -np {np_} --min-np {min_np} | kill -9 of rank {victim} after "
                  f"'{when}' | exit {status} | {'finished' if ok else 'FAILED'} | "
                  f"{time.monotonic() - start:.0f} s |")
            if not ok:
                print(out[-3000:], file=sys.stderr)
    return 1 if failed else 0


def launcher(np_, min_np, script, *args):
    return [sys.executable, "-m", "mpilearn.run", "-np", str(np_), "--min-np", str(min_np),
            sys.executable, script, *args]


if __name__ == "__main__":
    sys.exit(main())
