"""A user's own small job, as a user writes it: a model module, their data as an .npz
and a minimal spec (used by the first-hour tests and the run start-up bench)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

MODEL = '''import keras


def build(hidden=16):
    return keras.Sequential([keras.Input(shape=(20,)),
                             keras.layers.Dense(hidden, activation="relu"),
                             keras.layers.Dense(3, activation="softmax")])
'''

MINIMAL = "name: mine\nmode: vcasgd\nmodel: mymodel:build\ndataset: {train: data.npz}\ntraining: {epochs: 2}\n"


def user_files(tmp: Path, spec: str = MINIMAL, model: str = MODEL, n: int = 400) -> Path:
    """The user's model module, their data as an .npz (3 classes, 20 features) and spec,
    written into ``tmp`` (made if missing); the spec's path."""
    from sklearn.datasets import make_classification

    tmp.mkdir(parents=True, exist_ok=True)
    x, y = make_classification(n_samples=n, n_features=20, n_informative=10, n_classes=3,
                               class_sep=2.0, random_state=0)
    np.savez(tmp / "data.npz", x=x.astype(np.float32), y=y.astype(np.int64))
    (tmp / "mymodel.py").write_text(model)
    (tmp / "job.yaml").write_text(spec)
    return tmp / "job.yaml"
