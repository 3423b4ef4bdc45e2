"""Search spaces: real (linear or log), integer and categorical parameters.

YAML form (``search.space``)::

    lr:          {type: real, low: 1.0e-4, high: 1.0e-2, log: true}
    hidden:      {type: int, low: 8, high: 64}
    optimizer:   {type: categorical, choices: [adam, sgd]}
    loss_weights.0: {type: real, low: 1, high: 8}       # an element of a list hparam

A parameter without ``default`` takes it from the model file's ``DEFAULTS``. Every point is
also encoded in the unit cube (one gene per parameter) for the evolutionary searcher.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ..errors import UsageError

TYPES = ("real", "int", "categorical")
FIELDS = ("type", "low", "high", "log", "choices", "default")


@dataclass
class Param:
    name: str
    type: str
    low: Optional[float] = None
    high: Optional[float] = None
    log: bool = False
    choices: List[Any] = field(default_factory=list)
    default: Any = None

    def decode(self, u: float):
        """A unit-interval gene to a value."""
        u = min(max(float(u), 0.0), 1.0)
        if self.type == "categorical":
            return self.choices[min(int(u * len(self.choices)), len(self.choices) - 1)]
        if self.log:
            value = math.exp(math.log(self.low) + u * (math.log(self.high) - math.log(self.low)))
        else:
            value = self.low + u * (self.high - self.low)
        if self.type == "int":
            return int(min(max(round(value), self.low), self.high))
        return float(value)

    def encode(self, value) -> float:
        if self.type == "categorical":
            return (self.choices.index(value) + 0.5) / len(self.choices)
        if self.log:
            return (math.log(value) - math.log(self.low)) / (math.log(self.high) - math.log(self.low))
        return (value - self.low) / (self.high - self.low) if self.high > self.low else 0.5


class Space:
    def __init__(self, params: Sequence[Param]):
        self.params = list(params)
        self.names = [p.name for p in self.params]

    @classmethod
    def from_config(cls, spec: dict, defaults: Optional[dict] = None, where: str = "search.space",
                    known: Optional[set] = None):
        """``known``: the hyperparameters the model declares (its ``DEFAULTS``); a name outside
        them would tune nothing, and is bad input."""
        if not isinstance(spec, dict) or not spec:
            raise UsageError(f"{where} must be a non-empty mapping of parameters")
        from ..train.checks import did_you_mean

        params = []
        for name, p in spec.items():
            key = f"{where}.{name}"
            if not isinstance(p, dict):
                raise UsageError(f"{key} must be a mapping with 'type'")
            unknown = sorted(map(str, set(p) - set(FIELDS)))
            if unknown:
                raise UsageError(f"{key}: unknown field(s) "
                                 + ", ".join(u + did_you_mean(u, FIELDS) for u in unknown)
                                 + f"; a parameter's fields are {', '.join(FIELDS)}")
            kind = p.get("type")
            if kind not in TYPES:
                raise UsageError(f"{key}.type is {kind!r}{did_you_mean(str(kind), TYPES)}; "
                                 f"choose one of {', '.join(TYPES)}")
            default = p.get("default", _lookup(defaults or {}, name))
            if kind == "categorical":
                choices = p.get("choices")
                if not isinstance(choices, list) or not choices:
                    raise UsageError(f"{key}.choices must be a non-empty list")
                params.append(Param(name, kind, choices=choices, default=default))
                continue
            low, high = p.get("low"), p.get("high")
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)):
                raise UsageError(f"{key} needs numeric 'low' and 'high'")
            if low >= high:
                raise UsageError(f"{key}: empty or inverted range: low {low} >= high {high}")
            if p.get("log") and low <= 0:
                raise UsageError(f"{key}: a log range needs low > 0, got {low}")
            if kind == "int" and (int(low) != low or int(high) != high):
                raise UsageError(f"{key}: int bounds must be integers")
            params.append(Param(name, kind, float(low), float(high), bool(p.get("log", False)),
                                default=default))
        for name in spec:
            top = name.split(".")[0]
            if known and top not in known:
                raise UsageError(f"{where}.{name}: the model has no hyperparameter '{top}'"
                                 f"{did_you_mean(top, known)}; its DEFAULTS are: "
                                 f"{', '.join(sorted(known))}")
            if "." in name and defaults is not None:
                _check_reach(f"{where}.{name}", defaults, name)
        return cls(params)

    def size(self) -> Optional[int]:
        """The number of distinct points, or None when a parameter is real."""
        n = 1
        for p in self.params:
            if p.type == "real":
                return None
            n *= len(p.choices) if p.type == "categorical" else int(p.high - p.low) + 1
        return n

    def grid(self) -> List[Dict[str, Any]]:
        """Every point of a finite space."""
        import itertools

        axes = [p.choices if p.type == "categorical" else list(range(int(p.low), int(p.high) + 1))
                for p in self.params]
        return [dict(zip(self.names, values)) for values in itertools.product(*axes)]

    def sample(self, rng: np.random.Generator) -> Dict[str, Any]:
        return self.decode(rng.random(len(self.params)))

    def decode(self, genes) -> Dict[str, Any]:
        return {p.name: p.decode(u) for p, u in zip(self.params, genes)}

    def encode(self, point: Dict[str, Any]) -> List[float]:
        return [p.encode(point[p.name]) for p in self.params]

    def skopt_dimensions(self):
        from skopt.space import Categorical, Integer, Real

        dims = []
        for p in self.params:
            if p.type == "categorical":
                dims.append(Categorical(p.choices, name=p.name))
            elif p.type == "int":
                dims.append(Integer(int(p.low), int(p.high), prior="log-uniform" if p.log else "uniform",
                                    name=p.name))
            else:
                dims.append(Real(p.low, p.high, prior="log-uniform" if p.log else "uniform", name=p.name))
        return dims


def _lookup(tree: dict, dotted: str):
    node = tree
    for part in dotted.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _check_reach(key: str, tree: dict, dotted: str) -> None:
    """A dotted name reaches into a mapping, an element of a list, or a value left None (the
    trial then gives the model a mapping of overrides, ``{"2": 30.0}``, as the 3DGAN's
    ``loss_weights`` takes): anything else would fail in every trial."""
    parent, _, last = dotted.rpartition(".")
    node = _lookup(tree, parent)
    if node is None or isinstance(node, dict) or (
            isinstance(node, (list, tuple)) and last.isdigit() and int(last) < len(node)):
        return
    raise UsageError(f"{key}: hparams.{parent} is {node!r} here (the config's or the model's "
                     f"default), which has no element '{last}'")


def apply(hparams: dict, point: Dict[str, Any], defaults: Optional[dict] = None) -> dict:
    """hparams with the point's values set (dotted names reach into dicts and lists; one that
    the hparams lack starts from the model's ``defaults``: ``g_channels.1`` changes one width
    of the default list)."""
    out = json.loads(json.dumps(hparams))
    for dotted, value in point.items():
        parts = dotted.split(".")
        if len(parts) > 1 and parts[0] not in out and (defaults or {}).get(parts[0]) is not None:
            out[parts[0]] = json.loads(json.dumps(defaults[parts[0]]))
        node = out
        for part in parts[:-1]:
            if isinstance(node, list):
                node = node[int(part)]
            else:
                node = node.setdefault(part, {})
        last = parts[-1]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return out


def trial_key(point: Dict[str, Any]) -> str:
    """A trial's identity: a hash of its parameters (same parameters, same key)."""
    text = json.dumps({k: (round(v, 12) if isinstance(v, float) else v) for k, v in sorted(point.items())},
                      sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


class KeyView:
    """The keys a batch must not return: a live view over the caller's sets plus the keys the
    batch adds. A copy would cost O(keys) per batch: at 16 384 blocks the sweep's 160 000
    keys took 8-16 ms a copy, twice a batch, holding the GIL, and the searcher thread fell
    behind (59 % of requests queued for a model point, 28 % fallbacks)."""

    def __init__(self, *bases):
        self.bases, self.added = bases, set()

    def __contains__(self, key) -> bool:
        return key in self.added or any(key in base for base in self.bases)

    def add(self, key) -> None:
        self.added.add(key)
