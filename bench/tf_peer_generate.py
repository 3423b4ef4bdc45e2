"""Showers from the peer's saved generator weights, built by the peer's own model code.

Runs in the peer's environment (TensorFlow with Keras 2: tf-keras, TF_USE_LEGACY_KERAS=1),
without mpilearn. Builds ``generator_model`` from PEER_DIR/gan_models.py exactly as its
gan_main.py does (latent 256, its data format), loads PEER_DIR's saved
``params_generator_epoch_NNN.hdf5`` and writes one shower per event of the conditions file,
in the calorimeter's HDF5 format that ``mpilearn.validate --generated`` reads: ``ECAL`` in
GeV x 50 (the generator's x^0.85 undone), ``energy`` in GeV and the angle under ``mtheta``,
each the conditions' own (the generator input is [E/100, mtheta, 254 normals], as in its
training loop).

    TF_USE_LEGACY_KERAS=1 python bench/tf_peer_generate.py PEER_DIR WEIGHTS.hdf5 MC.h5 OUT.h5
"""
import os
import sys

import h5py
import numpy as np

POWER, LATENT = 0.85, 256


def main():
    peer_dir, weights, conditions, out = sys.argv[1:5]
    dformat = sys.argv[5] if len(sys.argv) > 5 else "channels_first"  # gan_main.py's default
    sys.path.insert(0, os.path.abspath(peer_dir))
    import tensorflow as tf
    from gan_models import generator_model  # the peer's code, unchanged

    generator = generator_model(LATENT, dformat=dformat)
    generator.load_weights(weights)
    with h5py.File(conditions, "r") as h:
        energy = h["energy"][()].astype(np.float32)
        angle = h["mtheta"][()].astype(np.float32)
    rng = np.random.default_rng(0)
    parts = []
    for start in range(0, len(energy), 64):
        e, a = energy[start:start + 64], angle[start:start + 64]
        noise = rng.standard_normal((len(e), LATENT - 2)).astype(np.float32)
        x = np.concatenate([e[:, None] / 100.0, a[:, None], noise], axis=1)
        images = generator(tf.constant(x), training=False).numpy()
        images = images[:, 0] if dformat == "channels_first" else images[..., 0]
        parts.append(np.power(np.maximum(images, 0.0), 1.0 / POWER).astype(np.float32))
    ecal = np.concatenate(parts)
    with h5py.File(out, "w") as h:
        h.create_dataset("ECAL", data=ecal, compression="gzip", compression_opts=1)
        h.create_dataset("energy", data=energy)
        h.create_dataset("mtheta", data=angle)
    print(f"{len(ecal)} showers -> {out}")


if __name__ == "__main__":
    main()
