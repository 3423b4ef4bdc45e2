"""Standard test functions for searchers (minimisation), usable as function objectives:
``search.objective.function: mpilearn.hpo.benchmarks:branin``."""
import math

import numpy as np

BRANIN_MIN = 0.397887
HARTMANN6_MIN = -3.32237


def branin(p):
    x1, x2 = p["x1"], p["x2"]  # x1 in [-5, 10], x2 in [0, 15]
    a, b, c, r, s, t = 1, 5.1 / (4 * math.pi ** 2), 5 / math.pi, 6, 10, 1 / (8 * math.pi)
    return a * (x2 - b * x1 ** 2 + c * x1 - r) ** 2 + s * (1 - t) * math.cos(x1) + s


_A = np.array([[10, 3, 17, 3.5, 1.7, 8], [0.05, 10, 17, 0.1, 8, 14],
               [3, 3.5, 1.7, 10, 17, 8], [17, 8, 0.05, 10, 0.1, 14]])
_P = 1e-4 * np.array([[1312, 1696, 5569, 124, 8283, 5886], [2329, 4135, 8307, 3736, 1004, 9991],
                      [2348, 1451, 3522, 2883, 3047, 6650], [4047, 8828, 8732, 5743, 1091, 381]])
_ALPHA = np.array([1.0, 1.2, 3.0, 3.2])


def hartmann6(p):
    x = np.array([p[f"x{i}"] for i in range(1, 7)])  # each in [0, 1]
    return float(-np.sum(_ALPHA * np.exp(-np.sum(_A * (x - _P) ** 2, axis=1))))


ACKLEY10_MIN = 0.0


def ackley10(p):
    """Ackley in 10 dimensions on [-5, 10]^10 (the domain TuRBO's and BoTorch's papers use):
    one narrow global minimum, 0 at the origin, in a field of local ones."""
    x = np.array([p[f"x{i}"] for i in range(1, 11)])
    return float(-20 * np.exp(-0.2 * np.sqrt(np.mean(x ** 2)))
                 - np.exp(np.mean(np.cos(2 * np.pi * x))) + 20 + math.e)


GAN3D_LIKE_MIN = 1.0


def gan3d_like(p):
    """A closed-form stand-in for the 3DGAN's own sweep (FPD-like: minimum 1.0, lower is
    better): the learning rate, G's and D's widths and four loss weights, with the couplings a
    GAN has. The best lr falls as D widens (lr* = 1e-3 sqrt(8 / d_channels)); D wants to be a
    little narrower than G (d = 0.8 g); the weights matter relative to the BCE weight. An lr
    above 2.5 lr* diverges: the trial fails (None), as a GAN's NaN loss does. The minimum, 1.0,
    is at lr 1e-3, g 10, d 8 and weights (3, 0.3, 25, 0.1)."""
    lr_best = 1e-3 * math.sqrt(8 / p["d_channels"])
    lr = math.log(p["lr"] / lr_best)
    if lr > math.log(2.5):
        return None
    g, d, bce = math.log(p["g_channels"]), math.log(p["d_channels"]), math.log(p["w_bce"])
    return (GAN3D_LIKE_MIN + 4 * lr ** 2 + 2 * (g - math.log(10)) ** 2
            + 1.5 * (d - g - math.log(0.8)) ** 2 + 0.2 * (bce - math.log(3)) ** 2
            + 0.5 * (math.log(p["w_energy"]) - bce - math.log(0.1)) ** 2
            + 0.3 * (math.log(p["w_angle"]) - bce - math.log(25 / 3)) ** 2
            + 0.5 * (math.log(p["w_ecal"]) - bce - math.log(0.1 / 3)) ** 2)


def noisy_branin(p):
    rng = np.random.default_rng(abs(hash((round(p["x1"], 9), round(p["x2"], 9)))) % 2 ** 32)
    return branin(p) + rng.normal(0, 2.0)


def space(name):
    if name == "hartmann6":
        return {f"x{i}": {"type": "real", "low": 0.0, "high": 1.0} for i in range(1, 7)}
    if name == "gan3d_like":  # jobs/hpo-3dgan.yaml's and hpo-3dgan-smooth.yaml's axes, together
        return {"lr": {"type": "real", "low": 1.0e-4, "high": 3.0e-3, "log": True},
                "g_channels": {"type": "int", "low": 4, "high": 16},
                "d_channels": {"type": "int", "low": 4, "high": 16},
                "w_bce": {"type": "real", "low": 1.0, "high": 8.0},
                "w_energy": {"type": "real", "low": 0.05, "high": 1.0, "log": True},
                "w_angle": {"type": "real", "low": 5.0, "high": 50.0},
                "w_ecal": {"type": "real", "low": 0.05, "high": 1.0, "log": True}}
    if name == "ackley10":
        return {f"x{i}": {"type": "real", "low": -5.0, "high": 10.0} for i in range(1, 11)}
    return {"x1": {"type": "real", "low": -5.0, "high": 10.0},
            "x2": {"type": "real", "low": 0.0, "high": 15.0}}
