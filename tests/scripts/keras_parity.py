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
for variant, preset in (("angle", "full"), ("fixed", "full"), ("angle", "small")):
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
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
