"""Epoch-end evaluation of server weights on the validation split.

Runs in the long-lived work generator (TensorFlow is loaded once there), never in
the assimilator: the merge path stays numpy-only and fast.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


class Evaluator:
    """Loads the job's model file once and evaluates flat weight buffers on val data."""

    def __init__(self, model_file: Path, val_file: Path, loss: str, batch_size: int = 512):
        from boinc_dl.server.common.keras_model import configure_tf

        tf = configure_tf()
        self.model = tf.keras.models.load_model(model_file, compile=False)
        self.model.compile(loss=loss, metrics=["accuracy"])
        with np.load(val_file) as z:
            self.x, self.y = z["x"], z["y"]
        self.batch_size = batch_size

    def evaluate(self, flat: np.ndarray) -> tuple[float, float]:
        """(validation loss, validation accuracy) of the given weights."""
        from boinc_dl.server.common.keras_model import set_flat

        set_flat(self.model, flat)
        loss, acc = self.model.evaluate(self.x, self.y, batch_size=self.batch_size, verbose=0)
        return float(loss), float(acc)
