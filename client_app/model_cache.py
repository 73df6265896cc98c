"""Models kept loaded between units: a long-lived slot compiles each model once."""

from __future__ import annotations

import os
import shutil
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from boinc_dl.client_app.unit_inputs import Settings, UnitInputError, one_line
from boinc_dl.server.common.weights import Fingerprint
from boinc_dl.server.common.workunit import MODEL, WU_JSON


class _Trainer:
    """An optimizer plus compiled train/eval steps for one model and one set of settings."""

    def __init__(self, model: Any, settings: Settings, x_spec: Any, y_spec: Any):
        import keras
        import tensorflow as tf

        from boinc_dl.server.common.keras_model import make_optimizer

        try:
            loss_fn = keras.losses.get(settings.loss)
        except (ValueError, TypeError):
            loss_fn = None
        if not callable(loss_fn):
            raise UnitInputError(f"{WU_JSON}: training.loss: unknown Keras loss {settings.loss!r}")
        self.optimizer = make_optimizer(settings.optimizer, settings.learning_rate, settings.momentum)
        # Build the slot variables now, outside the traced function, so that they can
        # be reset and checkpointed before the first step.
        self.optimizer.build(model.trainable_variables)
        opt = self.optimizer
        n_out = model.outputs[0].shape[-1] if getattr(model, "outputs", None) else None

        def n_correct(y: Any, pred: Any) -> Any:
            if y.shape.rank == pred.shape.rank and (n_out or 0) > 1:  # one-hot labels
                hit = tf.equal(tf.argmax(y, -1), tf.argmax(pred, -1))
            elif (n_out or 0) == 1:  # one sigmoid unit
                hit = tf.equal(tf.cast(tf.reshape(pred, [-1]) > 0.5, tf.int32),
                               tf.cast(tf.reshape(y, [-1]), tf.int32))
            else:
                hit = tf.equal(tf.cast(tf.argmax(pred, -1), tf.int32), tf.cast(tf.reshape(y, [-1]), tf.int32))
            return tf.reduce_sum(tf.cast(hit, tf.float64))

        @tf.function(input_signature=[x_spec, y_spec], autograph=False)
        def train_step(x: Any, y: Any) -> tuple[Any, Any]:
            with tf.GradientTape() as tape:
                pred = model(x, training=True)
                per_example = loss_fn(y, pred)
                loss = tf.reduce_mean(per_example)
                if model.losses:  # regularisation terms, as Keras' fit adds them
                    loss = loss + tf.add_n(model.losses)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return tf.reduce_sum(tf.cast(per_example, tf.float64)), n_correct(y, pred)

        @tf.function(input_signature=[x_spec, y_spec], autograph=False)
        def eval_step(x: Any, y: Any) -> tuple[Any, Any]:
            pred = model(x, training=False)
            return tf.reduce_sum(tf.cast(loss_fn(y, pred), tf.float64)), n_correct(y, pred)

        self.train_step = train_step
        self.eval_step = eval_step

    def reset(self, learning_rate: float) -> None:
        """Fresh optimizer state (zeroed slots and step counter) at a new learning rate.

        Cheaper than recompiling between units, and bitwise the same as a new optimizer.
        """
        lr_var = self.optimizer.learning_rate
        for v in self.optimizer.variables:
            if v is not lr_var:
                v.assign(np.zeros(tuple(v.shape), dtype=v.dtype))
        self.optimizer.learning_rate = learning_rate


@dataclass
class _Entry:
    model: Any
    fingerprint: Fingerprint
    trainers: dict[tuple[Any, ...], _Trainer] = field(default_factory=dict)
    units: int = 0


class ModelCache:
    """Loaded models and their compiled steps, kept across units in one process.

    Keyed by the SHA-256 of ``model.keras``, so a long-lived worker does not reload
    the model nor retrace its steps for each unit. Least recently used entries are
    dropped beyond ``max_models``.
    """

    def __init__(self, max_models: int = 2):
        self.max_models = max(1, int(max_models))
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, sha: object) -> bool:
        return sha in self._entries

    def clear(self) -> None:
        """Forget every cached model."""
        self._entries.clear()

    def get(self, path: Path, sha: str, scratch_dir: Path | None = None) -> tuple[_Entry, bool]:
        """The entry for the model file ``path`` whose hash is ``sha``; True if cached.

        ``scratch_dir`` may receive a short-lived file while the model loads.
        """
        entry = self._entries.get(sha)
        if entry is not None:
            self._entries.move_to_end(sha)
            return entry, True
        import keras

        from boinc_dl.server.common.keras_model import model_fingerprint

        try:
            model = _load_keras_file(keras, path, sha, scratch_dir or path.parent)
        except Exception as e:  # noqa: BLE001 - any loader failure means a bad model file
            raise UnitInputError(f"{MODEL}: cannot load the Keras model ({type(e).__name__}: {one_line(e)})") from None
        if not isinstance(model, keras.Model):
            raise UnitInputError(f"{MODEL}: holds a {type(model).__name__}, not a Keras model")
        if len(model.inputs) != 1 or len(model.outputs) != 1:
            raise UnitInputError(f"{MODEL}: the client trains single-input, single-output models "
                                 f"(this one has {len(model.inputs)} inputs, {len(model.outputs)} outputs)")
        entry = _Entry(model, model_fingerprint(model))
        self._entries[sha] = entry
        while len(self._entries) > self.max_models:
            self._entries.popitem(last=False)
        return entry, False

    @staticmethod
    def trainer(entry: _Entry, settings: Settings, x: np.ndarray, y: np.ndarray) -> _Trainer:
        """The entry's trainer for these settings and data layout (built on first use)."""
        import tensorflow as tf

        x_spec = tf.TensorSpec((None, *x.shape[1:]), tf.as_dtype(x.dtype))
        y_spec = tf.TensorSpec((None, *y.shape[1:]), tf.as_dtype(y.dtype))
        key = (settings.optimizer, settings.momentum, settings.loss, str(x_spec), str(y_spec))
        tr = entry.trainers.get(key)
        if tr is None:
            tr = entry.trainers[key] = _Trainer(entry.model, settings, x_spec, y_spec)
        return tr


def _load_keras_file(keras: Any, path: Path, sha: str, scratch_dir: Path) -> Any:
    """Load a ``.keras`` file whatever its name.

    Keras only recognises the format by the ``.keras`` suffix, and BOINC's physical
    file names have none: load through a temporary suffixed link (or copy) in
    ``scratch_dir`` (the slot directory, which the app may always write) instead.
    """
    if path.suffix == ".keras":
        return keras.models.load_model(path, compile=False)
    alias = scratch_dir / f".model.{sha[:16]}.{os.getpid()}.keras"
    try:
        alias.unlink(missing_ok=True)
        try:
            alias.symlink_to(path.resolve())
        except OSError:  # no symlinks (some filesystems, Windows without privilege)
            shutil.copyfile(path, alias)
        return keras.models.load_model(alias, compile=False)
    finally:
        alias.unlink(missing_ok=True)
