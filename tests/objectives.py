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


def curve_value(x, step):
    """A learning curve per trial: the parameter sets its floor and its speed."""
    return (x - 0.4) ** 2 + (0.3 + x) / step


def curve(p, report):
    """Reports 8 steps; returns early when the pruner says stop (as an Optuna objective would)."""
    value = None
    for step in range(1, 9):
        value = curve_value(p["x"], step)
        if report is not None and report(step, value):
            break
    return value


def two_objectives(p):
    """ZDT1-like pair on (x, y): a trade-off front."""
    f1 = p["x"]
    g = 1 + 9 * p["y"]
    return f1, g * (1 - math.sqrt(f1 / g))


def chatty(p):
    """Prints, as training code does: the sweep's log must say which trial and fold spoke."""
    print(f"hello from x={p['x']:.3f}")
    print("two lines\nat once", flush=True)
    return p["x"]
