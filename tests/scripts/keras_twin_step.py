"""The PyTorch 3DGAN and its Keras twin take the same training step from the same weights.

    KERAS_BACKEND=torch python keras_twin_step.py OUT.json

Small angle model, float64, no dropout (the frameworks draw different masks), batch norm on:
the PyTorch weights are copied into the Keras model, then each task takes one step (D on real,
D on a fake batch from G in inference mode, G twice) on the same batch, and OUT gets the
largest weight difference relative to how far the weights moved, and both tasks' losses.
The twins differ by about 1e-7 within the step: the Keras task takes the shared draws (noise,
label flips) as float32, the PyTorch one in its dtype. After it they part further: PyTorch keeps
the unbiased batch variance as batch norm's running variance, Keras the biased one.
"""
import json
import os
import sys

import keras
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "models"))
import gan3d  # noqa: E402
import gan3d_keras as gk  # noqa: E402

import mpilearn.torch as hvd  # noqa: E402
from mpi4py import MPI  # noqa: E402

keras.config.set_floatx("float64")
hvd.init()
HPARAMS = {"preset": "small", "dropout": 0.0}
torch.manual_seed(1)
twins = {"torch": gan3d.build({**HPARAMS, "dtype": "float64"}), "keras": gk.build(HPARAMS)}
for name in ("generator", "discriminator"):
    gk.from_torch(twins["torch"].models()[name], twins["keras"].models()[name])
rng = np.random.default_rng(0)
n = 4
ecal = rng.gamma(0.5, 2.0, (n, 51, 51, 25)) * (rng.random((n, 51, 51, 25)) < 0.05)
batch = {"ECAL": ecal.astype("float32"), "energy": rng.uniform(100, 200, n),
         "mtheta": rng.uniform(1.2, 1.9, n), "_index": np.arange(n)}


def weights(models):
    return [np.asarray(keras.ops.convert_to_numpy(w)).copy()
            for m in models for w in m.trainable_weights]


keras_models = [twins["keras"].models()[k] for k in ("generator", "discriminator")]
start = weights(keras_models)
losses = {}
for name, task in twins.items():
    task.setup(MPI.COMM_SELF, "cpu", "mpi", 0)
    losses[name] = task.train_step(task.transform(dict(batch)))
# PyTorch's new weights, copied into fresh Keras models: Keras's order and layout
fresh = gk.networks(HPARAMS)
for torch_model, keras_model in zip((twins["torch"].generator, twins["torch"].discriminator), fresh):
    gk.from_torch(torch_model, keras_model)
after_keras, after_torch = weights(keras_models), weights(fresh)
moved = max(float(np.max(np.abs(b - a))) for a, b in zip(start, after_keras))
diff = max(float(np.max(np.abs(a - b))) for a, b in zip(after_torch, after_keras))
json.dump({"moved": moved, "rel_diff": diff / moved, "losses": losses}, open(sys.argv[1], "w"),
          default=float)
