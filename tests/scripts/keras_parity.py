"""Copy the PyTorch 3DGAN's weights into the Keras one and compare outputs (inference mode).

    KERAS_BACKEND=... python keras_parity.py OUT.json
Prints, per variant/preset, the trainable counts of both and the largest relative error of
G's output and of each D output. BN running statistics are randomised first, so that the
copy of every kind of weight is exercised.
"""
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "models"))
import gan3d  # noqa: E402
import gan3d_keras as gk  # noqa: E402

out = {}
for variant, preset in (("angle", "full"), ("fixed", "full"), ("angle", "small")):  # noqa
    torch.manual_seed(1)
    tg, td = gan3d.networks({"variant": variant, "preset": preset})
    kg, kd = gk.networks({"variant": variant, "preset": preset})
    for m in list(tg.modules()) + list(td.modules()):
        if isinstance(m, torch.nn.BatchNorm3d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.8, 1.2)
            m.bias.data.uniform_(-0.1, 0.1)
    gk.from_torch(tg, kg)
    gk.from_torch(td, kd)
    tg.eval(), td.eval()
    rng = np.random.default_rng(0)
    z = rng.normal(size=(3, kg.input_shape[1])).astype("float32")
    with torch.no_grad():
        g_torch = tg(torch.from_numpy(z)).numpy()
        images = np.abs(rng.normal(size=g_torch.shape)).astype("float32") * 0.1
        d_torch = [o.numpy() for o in td(torch.from_numpy(images))]
    g_keras = np.asarray(gk.keras.ops.convert_to_numpy(kg(z, training=False))).transpose(0, 4, 1, 2, 3)
    d_keras = [np.asarray(gk.keras.ops.convert_to_numpy(o))
               for o in kd(images.transpose(0, 2, 3, 4, 1), training=False)]
    rel = lambda a, b: float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-12))  # noqa: E731
    out[f"{variant}-{preset}"] = {
        "keras_trainable": [gk.trainable_count(kg), gk.trainable_count(kd)],
        "torch_trainable": [sum(p.numel() for p in m.parameters()) for m in (tg, td)],
        "g_rel_err": rel(g_torch, g_keras), "d_rel_err": [rel(a, b) for a, b in zip(d_torch, d_keras)]}

# the twins' discriminators on the showers the empty-image guard exists for: empty, faint, normal
torch.manual_seed(2)
_, td = gan3d.networks({"variant": "angle", "preset": "small"})
_, kd = gk.networks({"variant": "angle", "preset": "small"})
gk.from_torch(td, kd)
td.eval()
rng = np.random.default_rng(1)
faint = np.zeros((2, 1, 51, 51, 25), "float32")
faint[:, 0, 25, 25, 4:20] = 1e-4                     # powered units: raw ≈ 2e-5 per cell
faint[1, 0, 40, 30, 22] = 1e-6
normal = np.zeros((2, 1, 51, 51, 25), "float32")
normal[:, 0, 20:31, 20:31, 2:22] = rng.random((2, 11, 11, 20)).astype("float32")
for name, x in (("empty", np.zeros((2, 1, 51, 51, 25), "float32")), ("faint", faint),
                ("normal", normal)):
    with torch.no_grad():
        d_torch = [o.numpy() for o in td(torch.from_numpy(x))]
    d_keras = [np.asarray(gk.keras.ops.convert_to_numpy(o))
               for o in kd(x.transpose(0, 2, 3, 4, 1), training=False)]
    out[f"d_on_{name}"] = {"max_abs_err": [float(np.max(np.abs(a - b))) for a, b in zip(d_torch, d_keras)],
                           "torch_angle": d_torch[2].tolist(), "keras_angle": d_keras[2].tolist()}

# the twins' optimizers: 5 updates on the same small gradients (eps matters at this scale)
w0 = rng.normal(size=(4, 3)).astype("float32")
grads = [(rng.normal(size=(4, 3)) * 1e-4).astype("float32") for _ in range(5)]
tw = torch.nn.Parameter(torch.from_numpy(w0.copy()))
topt = torch.optim.RMSprop([tw], lr=1e-3, alpha=0.9, eps=1e-7)
result = {}
for name, kopt in (("reference", gk.ReferenceRMSprop(1e-3, rho=0.9, epsilon=1e-7)),
                   ("keras3", gk.keras.optimizers.RMSprop(1e-3, rho=0.9, epsilon=1e-7))):
    kv = gk.keras.Variable(w0.copy())
    kopt.build([kv])
    steps = []
    for g in grads:
        kopt.apply([gk.keras.ops.convert_to_tensor(g)], [kv])
        steps.append(np.asarray(gk.keras.ops.convert_to_numpy(kv)))
    result[name] = steps
for g in grads:
    tw.grad = torch.from_numpy(g)
    topt.step()
    result.setdefault("torch", []).append(tw.detach().numpy().copy())
moved = [float(np.max(np.abs(t - w0))) for t in result["torch"]]
for name in ("reference", "keras3"):
    out[f"rmsprop_{name}_max_err"] = [float(np.max(np.abs(k - t)) / m)
                                      for k, t, m in zip(result[name], result["torch"], moved)]
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
