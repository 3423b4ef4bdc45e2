"""The noise scale through the Horovod-shaped APIs, on linear regression held at a fixed point
(lr 0; closed form in tests/models/linreg.py): ``torch``: DistributedOptimizer.noise_scale;
``keras``: NoiseScaleCallback under model.fit(). Rank 0 prints the estimate as JSON."""
import json
import sys

import numpy as np

D, SIGMA, BATCH, STEPS = 8, 0.5, 8, 400
api = sys.argv[1]
a = np.random.default_rng(5).normal(size=D)
rng = np.random.default_rng(1000 + int(__import__("os").environ.get("OMPI_COMM_WORLD_RANK", 0)))
X = rng.normal(size=(BATCH * STEPS, D)).astype("float32")
y = (SIGMA * rng.normal(size=BATCH * STEPS)).astype("float32")  # w* = 0, the model at a

if api == "torch":
    import torch

    import mpilearn.torch as hvd

    hvd.init()
    model = torch.nn.Linear(D, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor(a, dtype=torch.float32)[None])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters())
    for s in range(STEPS):
        xb, yb = torch.from_numpy(X[s * BATCH:(s + 1) * BATCH]), torch.from_numpy(y[s * BATCH:(s + 1) * BATCH])
        opt.zero_grad()
        (0.5 * ((model(xb)[:, 0] - yb) ** 2).mean()).backward()
        opt.step()
    est = opt.noise_scale(BATCH)
else:
    import keras

    import mpilearn.keras as hvd

    hvd.init()
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1, use_bias=False)])
    model.layers[0].set_weights([a.reshape(D, 1).astype("float32")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)),
                  loss=lambda t, p: 0.5 * keras.ops.mean((p[:, 0] - t) ** 2), jit_compile=False)
    callback = hvd.callbacks.NoiseScaleCallback(BATCH)
    history = model.fit(X, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                        callbacks=[callback])
    est = dict(callback.history[-1], logged=history.history["critical_batch"][-1])
if hvd.rank() == 0:
    print(json.dumps(est))
