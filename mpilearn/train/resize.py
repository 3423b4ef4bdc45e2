"""The batch policy at a size change, and the one line that says what changed.

A run that goes on at another rank count (a resume after a stop signal, a crash, a SLURM resize
or a Kubernetes restart, or an elastic shrink or growth) keeps its data position in events
(``data/position.py``); what happens to the batch is ``train.elastic.batch``'s:

- ``rank`` (default): the per-rank batch stays, so the global batch follows the rank count, and
  ``train.lr_scaling`` is applied again for the new global batch (a warm-up in progress goes on
  from the same fraction of its epochs, ``lr_rules``);
- ``global``: the global batch stays, so the learning rate stays; the per-rank batch is the
  global batch over the new rank count, which must divide it.
"""
from __future__ import annotations

from typing import Optional

from ..errors import UsageError


def saved_batches(state: dict, config_batch: int) -> tuple:
    """(global batch, ranks that wrote it) of a checkpoint; one written before they were kept
    trained ``train.batch_size`` per rank."""
    ranks = state.get("world_size", 1)
    return state.get("global_batch") or config_batch * ranks, ranks


def local_batch(train: dict, shards: int, saved: Optional[tuple] = None) -> int:
    """The per-rank batch on ``shards`` data shards (ranks that read data), under the config's
    policy; ``saved``: (global batch, ranks) of the run being continued, None for a new run."""
    if saved is None or train["elastic"]["batch"] == "rank":
        return train["batch_size"]
    total, ranks = saved
    if total % shards:
        fits = [n for n in range(1, min(total, 4 * max(shards, ranks)) + 1) if total % n == 0]
        raise UsageError(f"train.elastic.batch: global keeps the global batch of {total} events "
                         f"(written by {ranks} ranks), which {shards} ranks cannot share evenly; "
                         f"run on {', '.join(map(str, fits))} ranks, or set "
                         "train.elastic.batch: rank")
    return total // shards


def describe(old_ranks: int, new_ranks: int, old_global: int, new_local: int, new_global: int,
             policy: str, old_lr: Optional[float], new_lr: Optional[float], rule: str,
             where: str) -> str:
    """The one line from rank 0 at a size change."""
    lr = ""
    if new_lr is not None:
        lr = f"; lr {old_lr:.6g} -> {new_lr:.6g} (train.lr_scaling: {rule})"
    return (f"mpilearn: {old_ranks} -> {new_ranks} ranks at {where}: global batch {old_global} "
            f"-> {new_global} ({new_local} per rank, train.elastic.batch: {policy}){lr}; "
            "RNG streams restart")
