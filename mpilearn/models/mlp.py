"""A small supervised example: an MLP regressor on the toy dataset (HDF5 keys X, y).

The builder contract every model file follows: ``build(hparams) -> task``. ``DEFAULTS`` lists
the hyperparameters it understands (HPO search spaces take their defaults from it).
"""
import torch
from torch import nn

from mpilearn.train import SupervisedTask

DEFAULTS = {"features": 8, "hidden": 32, "layers": 2, "lr": 0.01, "optimizer": "adam",
            "momentum": 0.0}
HPARAMS = {"features": "int [1, inf)", "hidden": "int [1, inf)", "layers": "int [0, inf)",
           "lr": "[0, inf)", "optimizer": ["adam", "sgd"], "momentum": "[0, 1]"}


def build(hparams):
    hp = {**DEFAULTS, **hparams}
    layers, width = [], hp["features"]
    for _ in range(int(hp["layers"])):
        layers += [nn.Linear(width, int(hp["hidden"])), nn.Tanh()]
        width = int(hp["hidden"])
    model = nn.Sequential(*layers, nn.Linear(width, 1))
    if hp["optimizer"] == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=hp["lr"])
    elif hp["optimizer"] == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=hp["lr"], momentum=hp["momentum"])
    else:
        raise ValueError(f"hparams.optimizer must be adam or sgd, got {hp['optimizer']!r}")
    return SupervisedTask(model, nn.functional.mse_loss, opt,
                          metrics={"mae": lambda p, y: (p - y).abs().mean()},
                          inputs="X", target="y")
