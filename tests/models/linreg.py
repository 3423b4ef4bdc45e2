"""Linear regression held at a fixed point (lr 0): y = x . w* + sigma eps with Gaussian x, a model
at w* + a. Its gradient noise scale has a closed form (tests/test_noise_scale.py):
B_simple = ((d + 1)|a|² + d sigma²) / |a|²  for the loss (x . w - y)² / 2."""
import torch

from mpilearn.train.tasks import SupervisedTask

DEFAULTS = {"d": 8, "optimizer": "sgd", "lr": 0.0, "seed": 5}


def offset(d: int, seed: int) -> torch.Tensor:
    return torch.randn(d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def build(hparams):
    hp = {**DEFAULTS, **hparams}
    model = torch.nn.Linear(hp["d"], 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(offset(hp["d"], hp["seed"])[None])  # w* = 0
    opt = (torch.optim.SGD(model.parameters(), lr=hp["lr"]) if hp["optimizer"] == "sgd"
           else torch.optim.RMSprop(model.parameters(), lr=hp["lr"]))
    task = SupervisedTask(model, lambda pred, y: 0.5 * ((pred[:, 0] - y) ** 2).mean(), opt)
    task.dtype = torch.float64
    return task
