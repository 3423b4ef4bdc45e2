"""Plain-function objectives for HPO tests."""
import math
import time


def slow_quadratic(p):
    time.sleep(0.4)
    return (p["x"] - 0.3) ** 2


def fragile(p):
    """Raises or returns NaN in parts of the space: the sweep must record and go on."""
    if p["x"] > 0.8:
        raise RuntimeError("builder exploded")
    if p["x"] < 0.2:
        return math.nan
    return (p["x"] - 0.5) ** 2
