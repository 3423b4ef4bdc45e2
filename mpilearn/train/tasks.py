"""Tasks: what a model builder returns, and what the engine drives.

A task knows its models, optimizers and the HDF5 keys it reads, and does one training step on
a local batch. The engine owns everything around it: data, devices, allreduce set-up,
checkpoints, metrics. New kinds of training (the GAN task) are new Task classes.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional, Sequence, Union

import numpy as np
import torch

from .. import torch as mtorch


from ..errors import TrainingStopped  # noqa: F401  (raised by the tasks' guards)
from .guard import guarded_step
from ..allreduce.noise import measure_halves
from .speed import compile_model, to_channels_last, wants_channels_last


class Task:
    """The interface the engine calls. Subclasses fill in the four training hooks."""

    keys: Sequence[str] = ()
    optional_keys: Sequence[str] = ()
    device = "cpu"
    dtype = torch.float32
    precision = "fp32"  # "bf16": forward passes under torch.autocast (the engine sets it)
    # True: the task can divide its loss by the *global* event count itself, so that its
    # wrapped optimizers sum the gradients (op=Sum; setup sets ``sums_gradients``): the 1/N of
    # averaging then costs nothing, where op=Average multiplies every gradient buffer per step
    folds_average = False
    sums_gradients = False
    supports_autocast = True  # False where the framework has its own policy (Keras)
    compile_mode = "off"      # train.compile (the engine sets both; speed.py)
    channels_last = "auto"    # train.channels_last: auto (CUDA only) | true | false
    noise_scale = True        # train.noise_scale.enabled: measured by the wrapped optimizers
    halves_every = 0          # train.noise_scale.halves_every: one rank's measure (halves)

    def models(self) -> Dict[str, torch.nn.Module]:
        raise NotImplementedError

    def optimizers(self) -> Dict[str, torch.optim.Optimizer]:
        raise NotImplementedError

    def transform(self, batch: dict) -> dict:
        """Runs in the prefetch thread on numpy arrays: decoding, preprocessing."""
        return batch

    def train_step(self, batch: dict) -> Dict[str, float]:
        raise NotImplementedError

    def eval_batch(self, batch: dict) -> Dict[str, float]:
        """Sums over the batch's events (the engine divides by the global event count)."""
        raise NotImplementedError

    def callbacks(self, config: dict) -> tuple:
        """Callback classes (``train/callbacks.py``) this task needs under ``config``, run
        before the epoch log; the engine builds each with ``for_trainer``."""
        return ()

    # -- shared machinery --------------------------------------------------------------
    def setup(self, comm, device: str, backend: str, fusion_bytes: int,
              distributed: bool = True) -> None:
        """Move to ``device``, make every rank start from rank 0's weights, wrap optimizers
        (``distributed=False``: only the move; asynchronous training wraps them itself)."""
        self.device = device
        for model in self.models().values():
            model.to(device)
            if wants_channels_last(self.channels_last, device):
                to_channels_last(model)
            if self.compile_mode != "off":
                compile_model(model, self.compile_mode)
        self.sums_gradients = distributed and self.folds_average
        if not distributed:
            return
        for model in self.models().values():
            mtorch.broadcast_parameters(model.state_dict(), 0, comm=comm)
        for opt in self.optimizers().values():
            mtorch.broadcast_optimizer_state(opt, 0, comm=comm)
            mtorch.DistributedOptimizer(opt, backend=backend, comm=comm,
                                        fusion_threshold_bytes=fusion_bytes,
                                        op=mtorch.Sum if self.sums_gradients else mtorch.Average,
                                        noise_scale=self.noise_scale,
                                        halves_every=self.halves_every)

    def sync_models(self, comm, root: int = 0) -> None:
        """Every rank takes ``root``'s models (an elastic restore; weights are equal already,
        per-rank buffers such as batch-norm running statistics are not) and drops gradients
        its wrapped optimizers had half reduced."""
        for model in self.models().values():
            mtorch.broadcast_parameters(model.state_dict(), root, comm=comm)
        for opt in self.optimizers().values():
            reducer = getattr(opt, "_reducer", None)
            if reducer is not None:
                reducer.reset()

    # a task's own random streams beyond torch's, numpy's and Python's generators (which the
    # checkpoint holds itself): none here; Keras's seed generators (keras_tasks.py)
    def rng_state(self):
        return None

    def set_rng_state(self, state) -> None:
        pass

    def restart_streams(self) -> None:
        """The task's streams as a fresh process at any rank count has them."""

    def rebind(self, comm) -> None:
        """Train over ``comm`` from the next step on (the survivors after a lost rank): the
        wrapped optimizers' reducers and a task's own collectives (``self.comm``) follow."""
        if getattr(self, "comm", None) is not None:
            self.comm = comm
        for opt in self.optimizers().values():
            mtorch.optimizer.rebind(opt, comm)

    def autocast(self):
        """The forward passes' precision context: bf16 autocast (weights, gradients, optimizer
        state and the allreduce stay float32), or nothing."""
        kind = "cuda" if str(self.device).startswith("cuda") else "cpu"
        return torch.autocast(kind, dtype=torch.bfloat16, enabled=self.precision == "bf16")

    def learning_rates(self) -> Dict[str, List[float]]:
        """Each optimizer's learning rates (one per parameter group)."""
        return {k: [g["lr"] for g in o.param_groups] for k, o in self.optimizers().items()}

    def set_learning_rates(self, lrs: Dict[str, List[float]]) -> None:
        for k, o in self.optimizers().items():
            for g, lr in zip(o.param_groups, lrs[k]):
                g["lr"] = lr

    def allreduce_seconds(self) -> float:
        return sum(getattr(opt, "allreduce_seconds", 0.0) for opt in self.optimizers().values())

    def state_dict(self) -> dict:
        return {"models": {k: m.state_dict() for k, m in self.models().items()},
                "optimizers": {k: o.state_dict() for k, o in self.optimizers().items()}}

    def load_state_dict(self, state: dict) -> None:
        for k, m in self.models().items():
            m.load_state_dict(state["models"][k])
        for k, o in self.optimizers().items():
            o.load_state_dict(state["optimizers"][k])

    def tensor(self, array: np.ndarray, dtype=None) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(array), dtype=dtype or self.dtype).to(self.device)

    def export(self, folder: str) -> None:
        """Rank 0 at the end: each model's weights as plain PyTorch, ``<name>.pt`` (a
        ``state_dict``: ``model.load_state_dict(torch.load(path, weights_only=True))``) and
        ``<name>.safetensors``, written atomically."""
        from safetensors.torch import save

        from ..core.io import atomic_write_bytes

        os.makedirs(folder, exist_ok=True)
        for name, model in self.models().items():
            # unwrapped CPU copies: no DDP/compile prefixes, no shared storage (safetensors)
            state = {k: v.detach().cpu().clone().contiguous()
                     for k, v in getattr(model, "module", model).state_dict().items()}
            atomic_write_bytes(os.path.join(folder, f"{name}.pt"), lambda f: torch.save(state, f))
            atomic_write_bytes(os.path.join(folder, f"{name}.safetensors"),
                               lambda f: f.write(save(state)))


class SupervisedTask(Task):
    """A model, a loss and an optimizer: ``loss(model(*inputs), target)`` is minimised.

    ``loss`` and each metric return the mean over the batch; ``inputs`` and ``target`` name
    HDF5 dataset keys. ``target_dtype``: the target's torch dtype; by default an integer
    HDF5 target stays integer (``torch.long``: class indices, as ``CrossEntropyLoss`` wants)
    and any other becomes the task's float dtype.
    """

    def __init__(self, model: torch.nn.Module, loss: Callable, optimizer: torch.optim.Optimizer,
                 metrics: Optional[Dict[str, Callable]] = None,
                 inputs: Union[str, List[str]] = "X", target: str = "y",
                 transform: Optional[Callable[[dict], dict]] = None,
                 target_dtype=None):
        self.model, self.loss, self.optimizer = model, loss, optimizer
        self.metrics = dict(metrics or {})
        self.inputs = [inputs] if isinstance(inputs, str) else list(inputs)
        self.target = target
        self.keys = self.inputs + [target]
        self.loss_names = ["loss"]
        self.val_names = ["loss", *self.metrics]
        self._transform = transform
        self.target_dtype = target_dtype

    def models(self):
        return {"model": self.model}

    def optimizers(self):
        return {"optimizer": self.optimizer}

    def transform(self, batch):
        return self._transform(batch) if self._transform else batch

    def _forward(self, batch):
        xs = [self.tensor(batch[k]) for k in self.inputs]
        target = np.asarray(batch[self.target])
        dtype = self.target_dtype
        if dtype is None and (np.issubdtype(target.dtype, np.integer) or target.dtype == bool):
            dtype = torch.long
        return self.model(*xs), self.tensor(target, dtype)

    def train_step(self, batch):
        self.model.train()
        self.optimizer.zero_grad()
        with self.autocast():
            pred, y = self._forward(batch)
        pred = pred.float() if pred.dtype == torch.bfloat16 else pred
        # every event of this rank's batch skipped (data.on_error=skip): zeros, in step
        loss = self.loss(pred, y) if len(y) else pred.sum() * 0.0
        h = len(y) // 2
        if h:  # one rank: the noise scale from two halves, now and then (allreduce/noise.py)
            measure_halves(self.optimizer, lambda: self.loss(pred[:h], y[:h]) * (h / len(y)))
        loss.backward()
        # one host read: the finite check and the loss, before the step
        (value,) = guarded_step(self.optimizer, "local loss", loss)
        return {"loss": float(value)}

    @torch.no_grad()
    def eval_batch(self, batch):
        self.model.eval()
        pred, y = self._forward(batch)
        n = len(y)
        if n == 0:
            return {"loss": 0.0, **{name: 0.0 for name in self.metrics}}
        out = {"loss": float(self.loss(pred, y)) * n}
        for name, fn in self.metrics.items():
            out[name] = float(fn(pred, y)) * n
        return out
