"""Loading a user's model file: a Python file or module exposing one builder function.

The builder takes the hyperparameter dict and returns a task (see ``mpilearn.train.tasks``):

    def build(hparams: dict) -> mpilearn.train.SupervisedTask: ...

``model: path/to/file.py`` or ``model: package.module`` uses ``build``;
``model: file.py:make_task`` names another function.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from .errors import UsageError

BUILDER = "build"


def load_builder(spec: str):
    target, _, func = spec.partition(":")
    func = func or BUILDER
    if target.endswith(".py") or os.sep in target:
        if not os.path.isfile(target):
            raise UsageError(f"model file not found: {target}")
        name = "mpilearn_user_" + os.path.splitext(os.path.basename(target))[0]
        module_spec = importlib.util.spec_from_file_location(name, os.path.abspath(target))
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:
            raise UsageError(f"{target}: importing the model file failed: "
                             f"{type(err).__name__}: {err}") from None
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise UsageError(f"model module '{target}' cannot be imported: {err}") from None
    builder = getattr(module, func, None)
    if not callable(builder):
        raise UsageError(f"model '{target}' has no builder function '{func}(hparams)'")
    return builder


def default_hparams(spec: str) -> dict:
    """A model file may declare ``DEFAULTS = {...}``: its hyperparameters and their defaults."""
    builder = load_builder(spec)
    module = sys.modules.get(builder.__module__)
    return dict(getattr(module, "DEFAULTS", {}) or {})
