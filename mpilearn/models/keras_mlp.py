"""The supervised example in Keras 3: an MLP regressor on the toy dataset (HDF5 keys X, y).

A Keras model file may return a compiled keras.Model (as here) or a KerasSupervisedTask;
it runs on the TensorFlow backend, or on torch with KERAS_BACKEND=torch.
"""
import keras

DEFAULTS = {"features": 8, "hidden": 32, "layers": 2, "lr": 0.01}
HPARAMS = {"features": "int [1, inf)", "hidden": "int [1, inf)", "layers": "int [0, inf)",
           "lr": "[0, inf)"}


def build(hparams):
    hp = {**DEFAULTS, **hparams}
    layers = [keras.Input((int(hp["features"]),))]
    layers += [keras.layers.Dense(int(hp["hidden"]), activation="tanh") for _ in range(int(hp["layers"]))]
    model = keras.Sequential(layers + [keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(hp["lr"]), loss="mse")
    return model
