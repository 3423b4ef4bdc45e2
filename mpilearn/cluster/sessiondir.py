"""Open MPI's session directories that a killed launcher left behind.

Open MPI 5's ``mpirun`` (prterun, the same pid) keeps its session in ``$TMPDIR/ompi.<pid>``
and removes it when it ends; a SIGKILL (``mpilearn-run`` ending a job, the OOM killer, a
``kill -9``) leaves it there. When the pid comes round again (every 32 768 processes and
threads on a default Linux), the new launcher finds its rendezvous files already written and
stops before any rank runs: "The PMIx server's listener thread failed to start", exit 213
(PMIx 5.0's ``write_rndz_file`` refuses a file that exists). Removing the directories of
launchers no longer running, before a launch, prevents that."""
from __future__ import annotations

import os
import shutil
from typing import List, Mapping

from ..core.runlock import pid_alive

PREFIX = "ompi."


def tmp_base(env: Mapping[str, str] = os.environ) -> str:
    """Where Open MPI puts its session directories: its MCA setting, else $TMPDIR, $TEMP,
    $TMP, else /tmp (Open MPI's own order)."""
    for name in ("PRTE_MCA_prte_tmpdir_base", "TMPDIR", "TEMP", "TMP"):
        if env.get(name):
            return env[name]
    return "/tmp"


def remove(path: str) -> bool:
    """Moves ``path`` aside in one step (a launcher that reuses the pid meanwhile would find
    it gone, not half removed), then removes it. False when another cleaner got there first."""
    aside = f"{path}.left-behind.{os.getpid()}"
    try:
        os.rename(path, aside)
    except OSError:
        return False
    shutil.rmtree(aside, ignore_errors=True)
    return True


def remove_left_behind(env: Mapping[str, str] = os.environ) -> List[str]:
    """The session directories under :func:`tmp_base` that are this user's and whose launcher
    no longer runs (gone, or a zombie not yet reaped): removed. Returns their paths."""
    base = tmp_base(env)
    try:
        names = os.listdir(base)
    except OSError:
        return []
    removed = []
    for name in names:
        pid = name[len(PREFIX):]
        if not name.startswith(PREFIX) or not pid.isdigit():
            continue
        path = os.path.join(base, name)
        try:
            mine = os.stat(path).st_uid == os.getuid()
        except OSError:
            continue
        if mine and os.path.isdir(path) and not pid_alive(pid) and remove(path):
            removed.append(path)
    return removed


def main() -> int:
    """``python -m mpilearn.cluster.sessiondir``: what ``mpilearn-run`` does before a launch,
    for a plain ``mpirun`` (``make demo`` runs it first)."""
    for path in remove_left_behind():
        print(f"removed {path}: the session of a killed Open MPI launcher")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
