"""Process layout of a sweep, as a pure function of (world size, blocks, folds, ranks).

    rank 0                      coordinator (no device)
    ranks 1 .. B*W              B blocks of W ranks; W = K*R (folds in parallel) or R (in sequence)
    inside a block              fold f uses ranks f*R .. f*R+R-1 (parallel) or all R (sequential)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import UsageError


@dataclass(frozen=True)
class Role:
    coordinator: bool
    block: Optional[int] = None      # block index
    block_rank: Optional[int] = None
    fold_group: Optional[int] = None  # which fold this rank trains (parallel mode)
    fold_rank: Optional[int] = None


def block_width(folds: int, ranks_per_fold: int, fold_mode: str) -> int:
    return folds * ranks_per_fold if fold_mode == "parallel" else ranks_per_fold


def sweep_width(config: dict) -> int:
    """Ranks per trial (one block) of the sweep ``config`` describes."""
    s = config["search"]
    return block_width(s["folds"], s["ranks_per_fold"], s["fold_mode"])


def sweep_tasks(config: dict) -> int:
    """Ranks a sweep needs: 1 coordinator + blocks x block width."""
    return 1 + config["search"]["blocks"] * sweep_width(config)


def check(world_size: int, blocks: int, folds: int, ranks_per_fold: int, fold_mode: str) -> None:
    for name, v in (("search.blocks", blocks), ("search.folds", folds),
                    ("search.ranks_per_fold", ranks_per_fold)):
        if v < 1:
            raise UsageError(f"{name} must be at least 1, got {v}")
    if fold_mode not in ("parallel", "sequential"):
        raise UsageError(f"search.fold_mode is {fold_mode!r}; choose parallel or sequential")
    width = block_width(folds, ranks_per_fold, fold_mode)
    need = 1 + blocks * width
    if world_size != need:
        fits = world_size - 1 >= width and (world_size - 1) % width == 0
        hint = (f"; or keep np={world_size} with search.blocks={(world_size - 1) // width}"
                if fits else "")
        raise UsageError(
            f"np={world_size} does not fit the layout: 1 coordinator + {blocks} block(s) x "
            f"{width} rank(s) ({folds} fold(s) {fold_mode}, {ranks_per_fold} rank(s) each) needs "
            f"np={need}; valid np for this block shape: "
            f"{', '.join(str(1 + b * width) for b in range(1, 6))}, ...{hint}")


def role(rank: int, world_size: int, blocks: int, folds: int, ranks_per_fold: int,
         fold_mode: str) -> Role:
    check(world_size, blocks, folds, ranks_per_fold, fold_mode)
    if rank == 0:
        return Role(True)
    width = block_width(folds, ranks_per_fold, fold_mode)
    block, block_rank = divmod(rank - 1, width)
    if fold_mode == "parallel":
        fold_group, fold_rank = divmod(block_rank, ranks_per_fold)
    else:
        fold_group, fold_rank = None, block_rank
    return Role(False, block, block_rank, fold_group, fold_rank)
