"""``DistributedOptimizer`` with Horovod's signature and behaviour, on the fused reducer.

The user's optimizer keeps its class (``isinstance`` checks, LR schedulers and
``state_dict`` keep working): its class is swapped for a subclass that averages gradients
before ``step()``. Gradients go into flat buckets whose non-blocking allreduce starts from a
post-accumulate-grad hook, in the same bucket order on every rank; this fast path makes no
per-step metadata exchange, and the bucket layout is checked across ranks once, here.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Optional

import torch

from ..allreduce import make_backend
from ..allreduce.fusion import GradientReducer
from ..allreduce.noise import NoiseScale
from .basics import global_process_set, state_of
from .compression import Compression
from .engine import Adasum, Average, HorovodInternalError, Sum

_BACKENDS = {"default": "mpi"}


def set_default_backend(name: str) -> None:
    _BACKENDS["default"] = name


def get_backend(name: Optional[str] = None, comm=None, device: str = "cpu"):
    """One gradient transport per (name, communicator, device), created on first use."""
    from ..core import comm as _comm

    comm = comm if comm is not None else _comm.context().comm
    name = name or _BACKENDS["default"]
    key = (name, comm.py2f() if hasattr(comm, "py2f") else id(comm), device)
    if key not in _BACKENDS:
        _BACKENDS[key] = make_backend(name, comm, device)
    return _BACKENDS[key]


def rebind(optimizer, comm) -> None:
    """A DistributedOptimizer reduces over ``comm`` from its next step on (the survivors'
    communicator after a lost rank; ``mpilearn.core.membership``)."""
    reducer = getattr(optimizer, "_reducer", None)
    if reducer is None:
        return
    device = str(reducer.params[0].device) if reducer.params else "cpu"
    reducer.resize(get_backend(reducer.backend.name, comm, device), comm.Get_size())
    optimizer._synchronized = False


class _DistributedMixin:
    """Mixed into the user's optimizer class: gradients are reduced before ``step()``."""

    def _setup_distributed(self, reducer: Optional[GradientReducer], hooks: bool) -> None:
        self._reducer = reducer
        self._synchronized = False
        self._should_synchronize = True
        if reducer is not None and hooks:
            reducer.attach_hooks()

    def synchronize(self) -> None:
        """Wait for (and start, where backward did not) all gradient allreduces."""
        if self._reducer is not None:
            self._reducer.synchronize()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """``step()`` inside this block does not synchronize (after an explicit
        ``synchronize()``, e.g. for gradient clipping)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._reducer is not None and self._reducer.pending():
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        if self._reducer is None:
            return super().zero_grad(set_to_none=set_to_none)
        # Gradients that are views of the fusion buffers are zeroed in place, even with
        # set_to_none: the next backward then accumulates straight into the buffer. step()
        # is unchanged by it, because synchronize() gives every parameter a gradient anyway
        # (zeros where none was computed, as Horovod does). Other gradients follow set_to_none.
        bound = self._reducer.zero_grads()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or id(p) in bound:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad = p.grad.detach()
                    p.grad.zero_()

    def load_state_dict(self, state_dict):
        if self._reducer is not None:
            self._reducer.reset()
        self._synchronized = False
        self._should_synchronize = True
        return super().load_state_dict(state_dict)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        if self._reducer is not None:
            self._reducer.set_backward_passes(passes)

    def gradients_finite(self) -> bool:
        """Whether the last reduced gradients were all finite (identical on every rank)."""
        return self._reducer is None or self._reducer.all_finite()

    def noise_scale(self, batch_size: int, min_window: Optional[int] = None) -> Optional[dict]:
        """The gradient noise scale of this optimizer (mpilearn's; Horovod has none) over the
        steps since the last call (at least the newest ``min_window``, default 50), for ``batch_size``
        events per rank per step: ``b_simple`` (raw) and ``b_pre`` (in the optimizer's own
        preconditioning) in events with their standard errors, ``critical_batch`` (the one
        that governs this optimizer) and ``efficiency`` (data efficiency at the current global
        batch); ``mpilearn.allreduce.noise``. Local: no collective. None before two measured
        steps, at one rank, or when wrapped with ``noise_scale=False``."""
        noise = getattr(self._reducer, "noise", None) if self._reducer is not None else None
        if noise is None:
            return None
        noise.take_epoch(min_window)
        return noise.estimate(batch_size, batch_size * self._reducer.size)

    @property
    def allreduce_seconds(self) -> float:
        return self._reducer.pop_seconds() if self._reducer is not None else 0.0


def check_arguments(op, gradient_predivide_factor, backward_passes_per_step) -> None:
    """Horovod's checks, shared by the PyTorch and the Keras DistributedOptimizer."""
    if op == Adasum:
        raise NotImplementedError("Adasum is not implemented by mpilearn: use op=hvd.Average")
    if op not in (Average, Sum):
        raise ValueError("DistributedOptimizer supports op=hvd.Average or hvd.Sum")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")


def _check_named(optimizer, named_parameters) -> None:
    """Horovod's checks on ``named_parameters`` (a list of unique (name, parameter) tuples
    naming every parameter of the optimizer)."""
    if named_parameters is None:
        return
    named_parameters = list(named_parameters)
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [k for k, _ in named_parameters]
    dups = sorted({k for k in names if names.count(k) > 1})
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                         + ", ".join(dups))
    named_ids = {id(v) for _, v in named_parameters}
    unnamed = [id(v) for g in optimizer.param_groups for v in g["params"] if id(v) not in named_ids]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were "
                         "not named. Python object ids: " + ", ".join(map(str, unnamed)))


def _parameter_names(optimizer, named_parameters) -> dict:
    """Horovod's map parameter -> name; without ``named_parameters`` the same generated
    names on every rank (``allreduce.noname.<group>.<index>``)."""
    if named_parameters is not None:
        return {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0])}
    return {v: f"allreduce.noname.{i}.{j}" for i, g in enumerate(optimizer.param_groups)
            for j, v in enumerate(g["params"])}


def _groups(params, num_groups, groups):
    if groups is None and num_groups:
        groups = num_groups
    if groups is None:
        return None
    if isinstance(groups, list):
        seen = set()
        for g in groups:
            for p in g:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
        return groups
    if not isinstance(groups, int) or groups < 0:
        raise ValueError("groups should be a non-negative integer or a list of list of "
                         "torch.Tensor.")
    k, m = divmod(len(params), groups)
    return [params[i * k + min(i, m):(i + 1) * k + min(i + 1, m)] for i in range(groups)]


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set, *, backend: Optional[str] = None,
                         comm=None, fusion_threshold_bytes: int = 25 << 20,
                         noise_scale: bool = True, halves_every: int = 0):
    """Wrap ``optimizer`` so that ``step()`` applies gradients reduced over the process set
    (Horovod's arguments; ``backend``, ``comm`` and ``fusion_threshold_bytes`` are
    mpilearn's: the gradient transport, an explicit communicator, and the bucket size).
    ``noise_scale``: measure the gradient noise scale on every step (two squared norms per
    bucket and one 2-element allreduce; read it with ``optimizer.noise_scale(batch_size)``);
    ``halves_every``: at one rank, every that many steps a caller that passes the first half
    of its batch's gradients (``optimizer._reducer.noise.halves``) measures it there too."""
    check_arguments(op, gradient_predivide_factor, backward_passes_per_step)
    if named_parameters is not None:
        named_parameters = list(named_parameters)   # a generator is read twice below
    _check_named(optimizer, named_parameters)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    group_list = _groups(params, num_groups, groups)
    reducer, hooks = None, False
    member = comm is not None or process_set.included() is not False
    if member:
        state = state_of(process_set, comm)
        device = str(params[0].device) if params else "cpu"
        prescale, postscale = 1.0, 1.0
        if op == Average and gradient_predivide_factor != 1.0:
            prescale, postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
        reducer = GradientReducer(
            params, get_backend(backend, state.comm, device), state.size, fusion_threshold_bytes,
            average=(op == Average),
            compression=None if compression is Compression.none else compression,
            backward_passes=backward_passes_per_step, prescale=prescale, postscale=postscale,
            groups=group_list, sparse_as_dense=sparse_as_dense)
        layouts = state.sync.allgather(reducer.layout())
        if any(lay != layouts[0] for lay in layouts):
            raise HorovodInternalError(
                "DistributedOptimizer: the ranks' parameters differ (bucket sizes/dtypes "
                f"{layouts[0]} on rank 0, {reducer.layout()} here): build the same model on "
                "every rank")
        hooks = state.size > 1
        if noise_scale:
            reducer.noise = NoiseScale(optimizer, halves_every)
    base = optimizer.__class__
    if issubclass(base, _DistributedMixin):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    optimizer.__class__ = type(base.__name__, (_DistributedMixin, base),
                               {"__module__": base.__module__, "__qualname__": base.__qualname__})
    optimizer.backward_passes_per_step = backward_passes_per_step
    optimizer.op = op
    optimizer.gradient_predivide_factor = gradient_predivide_factor
    optimizer.process_set = process_set
    optimizer._parameter_names = _parameter_names(optimizer, named_parameters)
    optimizer._setup_distributed(reducer, hooks)
    return optimizer
