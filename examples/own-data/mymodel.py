"""Your model: a function returning an uncompiled Keras model (boinc-dl compiles it with
the spec's optimizer, learning rate and loss). Its keyword arguments come from the
spec's ``model_args`` (and, for model selection, from ``mop.param_grid``)."""

import keras


def build(hidden=32, n_features=20, n_classes=3):
    return keras.Sequential([
        keras.Input(shape=(n_features,)),
        keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dense(n_classes, activation="softmax"),
    ])
