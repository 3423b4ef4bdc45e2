"""The site profile's ``price``: what one device-hour costs, per device kind, in a named
currency (``python -m mpilearn.report`` turns device-hours into money with it).

    price: {gpu_hour: 2.5, cpu_hour: 0.05, currency: USD}

``gpu_hour`` prices one GPU for an hour (a rank on a GPU), ``cpu_hour`` one CPU rank for an
hour (a rank without a GPU, with the cores it was given); a run's device (``gpu`` or ``cpu``,
as mpilearn.hpo.cost records it) picks the rate. The old form, one number for every device
(``price: 2.5``), still reads, as a GPU-hour price with no currency (a CPU rank is never
charged a GPU's rate), with a warning naming the key.
"""
from __future__ import annotations

import re
import sys

from ..errors import UsageError

# key -> default (the default's type is the key's)
PRICE = {"gpu_hour": 0.0, "cpu_hour": 0.0, "currency": ""}
CURRENCY = re.compile(r"[A-Za-z]{1,16}$")  # ISO 4217 (USD, EUR, CHF) or a site's unit (credits)


def parse(value, source: str) -> dict:
    """``value`` (the profile's ``price``) checked and completed; bad input names the key."""
    from ..core.config import _check

    old = isinstance(value, (int, float)) and not isinstance(value, bool)
    if old:
        sys.stderr.write(
            f"mpilearn: warning: {source}: 'price: {value:g}' (one number for every device-hour) "
            f"is deprecated: it is read as price: {{gpu_hour: {value:g}}} (GPU-hours only) with "
            "no currency; write price: {gpu_hour: ..., cpu_hour: ..., currency: USD}\n")
        value = {"gpu_hour": float(value)}
    if not isinstance(value, dict):
        raise UsageError(f"{source}: 'price' must be a mapping such as {{gpu_hour: 2.5, "
                         f"cpu_hour: 0.05, currency: USD}}, got {value!r}")
    _check(value, PRICE, "price.", source, root={"price": PRICE})
    price = {**PRICE, **value}
    for key in ("gpu_hour", "cpu_hour"):
        price[key] = float(price[key])
        if price[key] < 0:
            raise UsageError(f"{source}: 'price.{key}' must be 0 or more, got {price[key]:g}")
    charged = price["gpu_hour"] or price["cpu_hour"]
    if price["currency"] and not CURRENCY.match(price["currency"]):
        raise UsageError(f"{source}: 'price.currency' is {price['currency']!r}: give a currency "
                         "code such as USD, EUR or CHF (letters only)")
    if charged and not price["currency"] and not old:
        raise UsageError(f"{source}: 'price.currency' is missing: name the currency of "
                         f"price.gpu_hour and price.cpu_hour (e.g. currency: USD)")
    return price


def per_hour(price: dict, device: str) -> float:
    """The rate for one device-hour of ``device`` ('gpu', else a CPU rank); 0: no price."""
    return price["gpu_hour"] if device == "gpu" else price["cpu_hour"]


def describe(price: dict, device: str) -> str:
    """'2.5 USD per GPU-hour' (or '... per CPU-rank-hour')."""
    unit = "GPU-hour" if device == "gpu" else "CPU-rank-hour"
    currency = f" {price['currency']}" if price["currency"] else ""
    return f"{per_hour(price, device):g}{currency} per {unit}"
