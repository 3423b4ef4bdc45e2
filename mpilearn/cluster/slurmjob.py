"""What SLURM says about a job, for decisions a job makes about another one (a lock's holder,
a stage or host file left behind). ``None`` means SLURM cannot tell (no ``scontrol``, no
controller): callers then fall back to what they can see themselves."""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Optional

# a job in one of these still runs (or is being torn down) somewhere
ALIVE = {"RUNNING", "SUSPENDED", "CONFIGURING", "COMPLETING", "SIGNALING", "STAGE_OUT",
         "RESIZING", "STOPPED"}


def this_job() -> str:
    return os.environ.get("SLURM_JOB_ID", "")


def state(job_id: str) -> Optional[str]:
    """``JobState`` of ``scontrol show job`` ("GONE" when SLURM no longer knows the job), or
    None when SLURM cannot be asked."""
    if not job_id or shutil.which("scontrol") is None:
        return None
    try:
        proc = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return "GONE" if "Invalid job id" in proc.stderr else None
    for field in proc.stdout.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return None


def running(job_id: str) -> Optional[bool]:
    """True while ``job_id`` runs, False once it ended (or is pending again), None: unknown."""
    found = state(job_id)
    return None if found is None else found in ALIVE
