"""Framework adapters: what the training strategies need from PyTorch or Keras, and nothing
more. A strategy (``strategies.py``) talks to tensors through an adapter, never to a framework.

=========================  ===========================================================
``tensors(opt)``           torch tensors of what ``opt`` updates (Keras: host copies)
``refresh(opt, ts)``       the copies take the variables' current values (no-op for torch)
``write(opt, ts)``         the variables take the copies' values (no-op for torch)
``model_tensors(task)``    every model's weights and float buffers, as torch tensors
``write_models(task, v)``  the models' weights and buffers take the values ``v``
``apply(opt, grads)``      one optimizer step with the given gradients
``broadcast(task)``        rank 0's weights and optimizer state to every rank
``hook_step(opt, w)``      the optimizer's step calls ``w.before_step(grads)`` and
                           ``w.after_step()``
=========================  ===========================================================
"""
from __future__ import annotations

from typing import List

import numpy as np
import torch


class TorchAdapter:
    name = "torch"

    def tensors(self, opt) -> List[torch.Tensor]:
        return [p for g in opt.param_groups for p in g["params"]]

    def model_tensors(self, task) -> List[torch.Tensor]:
        """Every model's floating-point parameters and buffers (batch-norm statistics)."""
        return [t for m in task.models().values() for t in m.state_dict().values()
                if t.is_floating_point()]

    def refresh(self, opt, tensors) -> None:
        pass

    def write(self, opt, tensors) -> None:
        pass

    def write_models(self, task, values) -> None:
        with torch.no_grad():
            for t, v in zip(self.model_tensors(task), values):
                t.copy_(v)

    def apply(self, opt, grads) -> None:
        for p, g in zip(self.tensors(opt), grads):
            p.grad = g.clone()
        opt.step()

    def broadcast(self, task, comm, optimizers: bool = True) -> None:
        from .. import torch as mtorch

        for model in task.models().values():
            mtorch.broadcast_parameters(model.state_dict(), 0, comm=comm)
        for opt in task.optimizers().values() if optimizers else ():
            mtorch.broadcast_optimizer_state(opt, 0, comm=comm)

    def hook_step(self, opt, worker) -> None:
        _subclass(opt, _TorchStepHook, worker)


class KerasAdapter:
    name = "keras"

    def tensors(self, opt) -> List[torch.Tensor]:
        return [_as_torch(v) for v in opt._trainable_variables]

    def model_tensors(self, task) -> List[torch.Tensor]:
        return [_as_torch(v) for m in task.models().values() for v in m.weights]

    def refresh(self, opt, tensors) -> None:
        for t, v in zip(tensors, opt._trainable_variables):
            t.copy_(_as_torch(v))

    def write(self, opt, tensors) -> None:
        for v, t in zip(opt._trainable_variables, tensors):
            v.assign(t.numpy())

    def write_models(self, task, values) -> None:
        weights = [v for m in task.models().values() for v in m.weights]
        for v, t in zip(weights, values):
            v.assign(t.numpy().astype(np.dtype(v.dtype)))

    def apply(self, opt, grads) -> None:
        opt.apply([g.numpy().copy() for g in grads], opt._trainable_variables)

    def broadcast(self, task, comm, optimizers: bool = True) -> None:
        from .. import keras as mkeras

        for model in task.models().values():
            mkeras.broadcast_variables(model.variables, 0, comm)
        for opt in task.optimizers().values() if optimizers else ():
            mkeras.broadcast_variables(opt.variables, 0, comm)

    def hook_step(self, opt, worker) -> None:
        _subclass(opt, _KerasStepHook, worker)


def adapter_for(task):
    return KerasAdapter() if getattr(task, "framework", "") == "keras" else TorchAdapter()


def _as_torch(variable) -> torch.Tensor:
    import keras

    return torch.from_numpy(np.array(keras.ops.convert_to_numpy(variable), dtype=np.float32))


# -- hooking a worker into the optimizer's own step ------------------------------------------

def _subclass(opt, mixin, worker) -> None:
    base = opt.__class__
    opt.__class__ = type(base.__name__, (mixin, base),
                         {"__module__": base.__module__, "__qualname__": base.__qualname__})
    opt._worker = worker


class _TorchStepHook:
    """``step()`` asks the worker first (True: the exchange replaced the step)."""

    def step(self, closure=None):
        w = self._worker
        if w.before_step([p.grad for p in w.flat.tensors]):
            return None
        result = super().step(closure)
        w.after_step()
        return result

    def gradients_finite(self) -> bool:
        return all(bool(torch.isfinite(p.grad).all()) for p in self._worker.flat.tensors
                   if p.grad is not None)

    @property
    def allreduce_seconds(self) -> float:
        return self._worker.pop_seconds()


class _KerasStepHook:
    """``apply()`` asks the worker first, with the gradients as torch tensors (so it cannot
    run inside a compiled graph)."""

    eager_only = True

    def apply(self, grads, trainable_variables=None):
        w = self._worker
        as_torch = [None if g is None else _as_torch(g) for g in grads]
        if w.before_step(as_torch):
            self.iterations.assign_add(1)
            return None
        result = super().apply(grads, trainable_variables)
        w.after_step()
        return result

    @property
    def allreduce_seconds(self) -> float:
        return self._worker.pop_seconds()
