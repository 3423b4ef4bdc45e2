"""How a task's PyTorch models run: memory layout (``train.channels_last``) and compilation
(``train.compile``). Both keep the parameters the same objects, so the optimizers, the fused
gradient buckets and their hooks, and ``state_dict`` (no ``_orig_mod.`` prefix) are unchanged.

Compilation is ``nn.Module.compile``: each model's forward (and, through AOTAutograd, its
backward) becomes compiled graphs. The parameters stay leaves outside the graphs, so their
gradients are still accumulated by the autograd engine, into the buckets' views, and each
parameter's post-accumulate hook still starts its bucket's allreduce as backward goes: the
collectives never enter a graph.
"""
from __future__ import annotations

import torch

COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
LAYOUTS = ("auto", "true", "false")


def wants_channels_last(setting: str, device: str) -> bool:
    """``auto``: on CUDA only (cuDNN's 3-D convolutions ran 16 % faster on an H100; on the
    CPU the 3DGAN measured no gain)."""
    return setting == "true" or (setting == "auto" and str(device).startswith("cuda"))


def to_channels_last(model: torch.nn.Module) -> None:
    """4-D tensors (2-D convolutions) to channels_last, 5-D (3-D) to channels_last_3d, in
    place: ``.data`` is replaced, the Parameter objects stay."""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.dim() in formats:
                t.data = t.data.contiguous(memory_format=formats[t.dim()])


def compile_model(model: torch.nn.Module, mode: str) -> None:
    """Compile ``model``'s forward in place (``mode`` one of COMPILE_MODES but ``off``)."""
    model.compile(mode=mode)
