"""k steps of a small Keras model with mpilearn.keras, in a custom loop or under model.fit().

    mpirun -np N python keras_equivalence.py MODE LOCAL_BATCH STEPS OUT.npz
Rank r of N takes rows [s*N*b + r*b, +b) at step s, so N ranks x b see what 1 rank x N*b sees.
"""
import sys

import keras
import numpy as np

import mpilearn.keras as hvd

mode, b, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
hvd.init()
n, r = hvd.size(), hvd.rank()
rng = np.random.default_rng(0)
X = rng.normal(size=(steps * n * b, 8)).astype("float32")
Y = (X @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(len(X), 1))).astype("float32")
rows = np.concatenate([np.arange(s * n * b + r * b, s * n * b + (r + 1) * b) for s in range(steps)])
x, y = X[rows], Y[rows]

keras.utils.set_random_seed(1 + r)  # different on purpose: the broadcast must fix it
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                          keras.layers.Dense(1)])
opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
mse = keras.losses.MeanSquaredError()

if mode == "fit":
    model.compile(optimizer=opt, loss=mse, jit_compile=False)
    model.fit(x, y, batch_size=b, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.BroadcastGlobalVariablesCallback(0), hvd.MetricAverageCallback()])
else:
    opt.build(model.trainable_variables)
    hvd.broadcast_variables(model.variables, 0)
    for s in range(steps):
        xb, yb = x[s * b:(s + 1) * b], y[s * b:(s + 1) * b]
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                loss = mse(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)
        else:
            import torch

            loss = mse(keras.ops.convert_to_tensor(yb), model(xb, training=True))
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                opt.apply([v.value.grad for v in model.trainable_weights], model.trainable_weights)
if r == 0:
    if keras.backend.backend() == "torch":  # the torch backend puts variables on the GPU
        print(f"variables on {model.weights[0].value.device}", flush=True)
    np.savez(out, *[np.asarray(keras.ops.convert_to_numpy(w)) for w in model.weights])
