"""A classifier with integer class targets (HDF5 int64 'label') and CrossEntropyLoss."""
import torch
from torch import nn

from mpilearn.train import SupervisedTask

DEFAULTS = {"lr": 0.05, "classes": 3}


def build(hparams):
    hp = {**DEFAULTS, **hparams}
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, hp["classes"]))

    def accuracy(logits, label):
        return (logits.argmax(1) == label).float().mean()

    return SupervisedTask(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=hp["lr"]),
                          metrics={"accuracy": accuracy}, inputs="X", target="label")
