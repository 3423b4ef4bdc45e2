"""Benchmark workload for DDP comparisons: the angle 3DGAN discriminator (87k parameters,
51x51x25 convolutions) trained as a supervised energy regressor on ECAL showers."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "models"))
import gan3d  # noqa: E402

from mpilearn.train import SupervisedTask  # noqa: E402


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        _, d = gan3d.angle_models(bn=True, dropout=0.0)
        self.body, self.energy = d.body, d.aux  # no unused heads: DDP rejects them

    def forward(self, ecal):
        x = ecal.unsqueeze(1).clamp_min(0) ** 0.85
        h = self.body(x).permute(0, 2, 3, 4, 1).flatten(1)
        return self.energy(h).squeeze(1)  # E/100


def build(hparams):
    model = Regressor()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3, alpha=0.9, eps=1e-7)
    return SupervisedTask(model, lambda pred, e: torch.nn.functional.mse_loss(pred, e / 100.0), opt,
                          inputs="ECAL", target="energy")
