"""Model builders for the examples: each returns an uncompiled Keras model."""

from __future__ import annotations


def mlp(input_dim: int = 64, hidden: int = 64, n_classes: int = 10, depth: int = 1, dropout: float = 0.0,
        l2: float = 0.0):
    """A small fully connected classifier (the digits examples' model)."""
    import keras

    reg = keras.regularizers.l2(l2) if l2 else None
    layers = [keras.Input(shape=(input_dim,))]
    for _ in range(depth):
        layers.append(keras.layers.Dense(hidden, activation="relu", kernel_regularizer=reg))
        if dropout:
            layers.append(keras.layers.Dropout(dropout))
    layers.append(keras.layers.Dense(n_classes, activation="softmax"))
    return keras.Sequential(layers)


def cnn(side: int = 8, channels: int = 1, n_classes: int = 10, filters: int = 16, hidden: int = 32):
    """A small convolutional classifier for flattened square images (digits 8x8, MNIST 28x28)."""
    import keras

    return keras.Sequential([
        keras.Input(shape=(side * side * channels,)),
        keras.layers.Reshape((side, side, channels)),
        keras.layers.Conv2D(filters, 3, activation="relu", padding="same"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dense(n_classes, activation="softmax"),
    ])
