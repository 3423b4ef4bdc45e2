"""A trained generator from a run: the checkpoint a path names, the run's config, the task with
its weights, and the generator with its post-processing as one module (``ShowerModel``), which
``generate``, ``export`` and ``bench/generate.py`` share. ``validate`` loads its task here too."""
from __future__ import annotations

import os

import torch

from ..errors import UsageError
from .format import GEOMETRY

def _best(folder: str):
    """``train.best``'s checkpoint in a checkpoints folder (``best.pt``), if there is one."""
    from ..train.best import BEST

    path = os.path.join(folder, BEST)
    return path if os.path.isfile(path) else None


def resolve_checkpoint(path: str, prefer_best: bool = False) -> str:
    """A checkpoint file from a file, a ``latest`` pointer, a checkpoints folder or a run
    directory; in a folder, ``best.pt`` (``train.best``) comes first with ``prefer_best``,
    else the ``latest`` one."""
    from ..train import checkpoint as ckpt

    if os.path.isdir(path):
        for folder in (path, os.path.join(path, "checkpoints")):
            found = (prefer_best and _best(folder)) or ckpt.latest(folder)
            if found:
                return found
        raise UsageError(f"no checkpoint in {path}")
    if os.path.basename(path) == ckpt.LATEST:
        found = ckpt.latest(os.path.dirname(path))
        if not found:
            raise UsageError(f"{path} points to no existing checkpoint")
        return found
    if not os.path.isfile(path):
        raise UsageError(f"checkpoint not found: {path}")
    return path


def run_config(checkpoint: str, config: str = None) -> dict:
    """The run's ``config.yaml`` (next to its ``checkpoints/``), or ``config``."""
    import yaml

    path = config or os.path.join(os.path.dirname(os.path.dirname(checkpoint)), "config.yaml")
    if not os.path.isfile(path):
        raise UsageError(f"run config not found: {path} (give it with --config)")
    with open(path) as f:
        return yaml.safe_load(f)


def load_task(checkpoint: str, config: dict):
    """(the run's task with the checkpoint's weights on the CPU, "epoch E [+ S steps]")."""
    from ..core.builders import load_builder
    from ..train import checkpoint as ckpt

    task = load_builder(config["model"])(dict(config.get("hparams") or {}))
    if not hasattr(task, "generate"):
        raise UsageError(f"model {config['model']} is not a generative (GAN) task")
    state = ckpt.load(checkpoint)
    task.device = "cpu"
    task.load_state_dict(state["task"])
    steps = state.get("step_in_epoch")
    return task, f"epoch {state.get('epoch')}" + (f" + {steps} steps" if steps else "")


class ShowerModel(torch.nn.Module):
    """The generator with its input layout and post-processing, as exported:

    inputs  ``noise`` (N, L) standard normal (L = 254 angle / 200 fixed), ``energy`` (N,) the
            primary energy / 100 GeV, ``angle`` (N,) the polar angle in rad (angle model only);
    latent  angle model: [E/100, θ, noise] (N, 256); fixed model: E/100 · noise (N, 200);
    output  ``cells_gev`` (N, X, Y, Z) cell energies in GeV: the generator's output inverted
            from the training scaling (angle: max(x, 0)^(1/0.85) / 50; fixed: x / 100).
    """

    def __init__(self, generator: torch.nn.Module, variant: str, bf16: bool = False):
        super().__init__()
        self.generator, self.variant = generator.eval(), variant
        self.bf16 = bf16  # the generator's layers under bf16 autocast (export --precision bf16)
        g = GEOMETRY[variant]
        self.power, self.unit, self.xscale = g["power"], g["unit"], g["xscale"]
        self.eval()  # inference only: batch norm's running statistics, no dropout

    def forward(self, noise, energy, angle=None):
        if self.variant == "angle":
            z = torch.cat([energy[:, None], angle[:, None], noise], dim=1)
        else:
            z = energy[:, None] * noise
        if self.bf16:  # not autocast(enabled=False): that would turn off a caller's autocast
            with torch.autocast(z.device.type, dtype=torch.bfloat16):
                x = self.generator(z)
        else:
            x = self.generator(z)
        x = x.squeeze(1).float()  # the post-processing in fp32
        if self.variant == "angle":
            return x.clamp_min(0).pow(1.0 / self.power) / self.unit
        return x / self.xscale


def is_keras(task) -> bool:
    return getattr(task, "framework", "torch") == "keras"


def shower_model(task) -> ShowerModel:
    """The task's generator as a :class:`ShowerModel` (PyTorch runs; UsageError for Keras)."""
    if is_keras(task):
        raise UsageError("this needs a PyTorch run; the run's model is a Keras one "
                         "(python -m mpilearn.generate makes its showers in fp32)")
    return ShowerModel(task.generator, task.variant)
