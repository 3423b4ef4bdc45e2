"""Shell lines that the SLURM and the MPIJob launcher scripts share."""

ENTRY = {"train": "mpilearn.train", "hpo": "mpilearn.optimize"}


def ulfm_flag(kind: str, config: dict) -> str:
    """Open MPI 5 mpirun's ``--with-ft ulfm`` for an elastic training (``train.elastic.min_ranks``
    > 0): its survivors then go on after a lost rank, instead of the job ending (and below
    ``min_ranks`` they checkpoint and exit 75, which requeues or restarts the job)."""
    elastic = (config.get("train") or {}).get("elastic") or {}
    return " --with-ft ulfm" if kind == "train" and int(elastic.get("min_ranks") or 0) > 0 else ""

# A signal caught by the script's trap ends `wait` early with 128+n while the launcher still
# runs: wait again. When the launcher has ended meanwhile, one more `wait` returns its own
# status (bash keeps it), not the interruption's 143: a job stopped with its state saved
# (75) must never read as killed.
WAIT_FOR_LAUNCHER = [
    'wait "$pid"; rc=$?',
    'while [ $rc -gt 128 ]; do',
    '  kill -0 "$pid" 2>/dev/null; running=$?',
    '  wait "$pid"; rc=$?',
    '  [ $running -eq 0 ] || break',
    'done',
]
