"""Validation: a task's eval_batch over held-out events, averaged over every rank's share."""
from __future__ import annotations

import itertools
import json
import os

import numpy as np

from ..data.hdf5 import DataError, eval_batches, one_message
from ..errors import TrainingStopped


def evaluate(task, source, events, batch_size: int, comm, cap: int = 0) -> dict:
    """Validation metrics averaged across ranks, over all ``events`` of ``source`` or, with
    ``cap`` > 0 (``train.max_steps_per_epoch``), at most that many batches per rank (as
    training); ``val_events`` says how many were evaluated. Collective."""
    if len(events) == 0:
        return {}
    sums, count = {}, 0
    batches = eval_batches(source, events, batch_size, comm.Get_rank(), comm.Get_size(),
                           task.transform)
    failed = None
    try:
        for batch in itertools.islice(batches, cap if cap > 0 else None):
            for k, v in task.eval_batch(batch).items():
                sums[k] = sums.get(k, 0.0) + v
            count += len(next(iter(batch.values())))
    except DataError as err:  # every rank hears of it below: one message for the job
        failed = err.where or str(err)
    seen = comm.allgather((set(sums), failed))
    failures = [(r, f) for r, (_, f) in enumerate(seen) if f]
    if failures:
        raise TrainingStopped(f"validation: {one_message(failures)}; replace the file, or set "
                              "data.on_error=skip, and continue with --resume")
    names = sorted(set().union(*(names for names, _ in seen)))
    vec = np.array([sums.get(k, 0.0) for k in names] + [count], dtype=np.float64)
    total = comm.allreduce(vec)
    return {**{f"val_{k}": float(total[i] / max(total[-1], 1)) for i, k in enumerate(names)},
            "val_events": int(total[-1])}


def test_pass(task, files, batch_size: int, comm, output: str, epoch: int,
              config: dict = None) -> dict:
    """Collective, once after the last epoch: ``data.test_files`` through the validation pass
    (every event), and the task's own test metrics (``task.test_metrics``, e.g. the GAN's
    physics numbers), appended to ``metrics.jsonl`` as ``{"test": ...}`` and written to
    ``test.json`` by rank 0."""
    from ..core.io import append_jsonl, atomic_write_text

    scores = evaluate(task, files, np.arange(len(files)), batch_size, comm)
    result = {"epoch": epoch, "files": list(files.paths),
              **{"test_" + k[len("val_"):]: v for k, v in scores.items()}}
    own = getattr(task, "test_metrics", None)
    mine = own(files, comm, output, config) if own is not None and config is not None else {}
    result.update({f"test_{k}": v for k, v in mine.items()})
    if comm.Get_rank() == 0:
        append_jsonl(os.path.join(output, "metrics.jsonl"), {"test": result})
        atomic_write_text(os.path.join(output, "test.json"), json.dumps(result, indent=1))
        # one short line: the losses, and the task's summary of its own numbers where it has
        # one (the full record is in test.json)
        summary = getattr(task, "test_summary", None)
        shown = {**{f"test_{k[len('val_'):]}": v for k, v in scores.items()},
                 **({} if summary else {f"test_{k}": v for k, v in mine.items()})}
        parts = [", ".join(f"{k} {v:.4g}" for k, v in shown.items() if isinstance(v, float))]
        if summary and mine:
            parts.append(summary(mine))
        print(f"mpilearn: test after epoch {epoch}: " + "; ".join(filter(None, parts)),
              flush=True)
    return result
