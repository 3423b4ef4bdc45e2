"""Loading a user's model file: a Python file or module exposing one builder function.

The builder takes the hyperparameter dict and returns a task (see ``mpilearn.train.tasks``):

    def build(hparams: dict) -> mpilearn.train.SupervisedTask: ...

``model: path/to/file.py`` or ``model: package.module`` uses ``build``;
``model: file.py:make_task`` names another function. Next to ``DEFAULTS`` a model file may
declare ``HPARAMS``, the values each hyperparameter accepts (checked before any compute):

    HPARAMS = {"preset": ["small", "full"], "lr": "(0, inf)", "layers": "int [1, inf)"}
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import math
import os
import re
import sys

from ..errors import UsageError

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


def _declared(spec: str, name: str) -> dict:
    module = sys.modules.get(load_builder(spec).__module__)
    return dict(getattr(module, name, {}) or {})


def default_hparams(spec: str) -> dict:
    """A model file may declare ``DEFAULTS = {...}``: its hyperparameters and their defaults."""
    return _declared(spec, "DEFAULTS")


# -- declared values: ``HPARAMS`` next to ``DEFAULTS`` ---------------------------------------
# A list names the allowed values; a string is an interval in the usual notation, optionally
# of integers: "(0, inf)", "[0, 1)", "int [1, inf)". A hyperparameter not in HPARAMS is not
# checked (its value is the builder's business).
_INTERVAL = re.compile(r"^\s*(int\s+)?([\[(])\s*([^,\s]+)\s*,\s*([^\])\s]+)\s*([\])])\s*$")


def declared_values(spec: str) -> dict:
    """The model file's ``HPARAMS`` (name -> allowed values or interval); {} if none."""
    return _declared(spec, "HPARAMS")


def _interval(rule: str):
    m = _INTERVAL.match(rule)
    if not m:
        raise UsageError(f"HPARAMS rule {rule!r} is not an interval such as '(0, inf)' or "
                         "'int [1, inf)'")
    integer, left, low, high, right = m.groups()
    return bool(integer), left == "(", float(low), float(high), right == ")"


def check_value(name: str, value, rule) -> None:
    """``value`` against its declared ``rule``; raises UsageError naming the key and value,
    with the nearest allowed value for a list of choices."""
    if isinstance(rule, (list, tuple)):
        if any(value == c and type(value) is type(c) for c in rule):
            return
        near = difflib.get_close_matches(str(value), [str(c) for c in rule], n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise UsageError(f"hparams.{name} is {value!r}: not one of "
                         f"{', '.join(map(repr, rule))}{hint}")
    integer, open_low, low, high, open_high = _interval(rule)
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = (is_number and not math.isnan(value)
          and (low < value if open_low else low <= value)
          and (value < high if open_high else value <= high)
          and (not integer or float(value).is_integer()))
    if not ok:
        kind = "an integer" if integer else "a number"
        interval = rule.strip().removeprefix("int").strip()
        raise UsageError(f"hparams.{name} is {value!r}: must be {kind} in {interval}")


def check_values(spec: str, hparams: dict, defaults: dict) -> None:
    """Every declared hyperparameter of ``{**defaults, **hparams}`` against ``HPARAMS``."""
    merged = {**defaults, **hparams}
    for name, rule in declared_values(spec).items():
        if name in merged:
            check_value(name, merged[name], rule)
