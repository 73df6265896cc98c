"""A unit's inputs: its training settings and the checks on its files (workunit, data,
weights), all cheap and done before TensorFlow is imported."""

from __future__ import annotations

import hashlib
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from boinc_dl.server.common.errors import BoincDLError
from boinc_dl.server.common.workunit import WU_JSON, Workunit

TRAINING_DEFAULTS: dict[str, Any] = {
    "batch_size": 32,
    "optimizer": "adam",
    "learning_rate": 0.001,
    "momentum": 0.0,
    "local_epochs": 1,
    "loss": "sparse_categorical_crossentropy",
}
OPTIMIZERS = ("adam", "sgd", "rmsprop", "adagrad")
# Short names a search space may use for a training setting (the full name wins).
HYPER_ALIASES = {"lr": "learning_rate"}


def one_line(e: BaseException) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= 300 else s[:297] + "..."



class UnitInputError(BoincDLError):
    """A permanent problem with the unit's input files: retrying on this host cannot help."""

    exit_code = 1


@dataclass(frozen=True)
class Settings:
    """The training settings of one unit: ``training`` with ``hyper`` overrides applied."""

    batch_size: int
    optimizer: str
    learning_rate: float
    momentum: float
    local_epochs: int
    loss: str

    @classmethod
    def from_workunit(cls, wu: Workunit) -> Settings:
        """Merge and validate; errors name the field (``training.batch_size: ...``)."""
        if not isinstance(wu.training, dict):
            raise UnitInputError(f"{WU_JSON}: training must be an object")
        if not isinstance(wu.hyper, dict):
            raise UnitInputError(f"{WU_JSON}: hyper must be an object")
        merged: dict[str, tuple[str, Any]] = {k: ("training", v) for k, v in TRAINING_DEFAULTS.items()}
        merged.update({k: ("training", v) for k, v in wu.training.items() if k in TRAINING_DEFAULTS})
        # MOP configurations carry their own learning rate, batch size, ...; other keys
        # in hyper (architecture arguments) are already baked into model.keras.
        merged.update({HYPER_ALIASES[k]: ("hyper", v) for k, v in wu.hyper.items()
                       if k in HYPER_ALIASES and HYPER_ALIASES[k] not in wu.hyper})
        merged.update({k: ("hyper", v) for k, v in wu.hyper.items() if k in TRAINING_DEFAULTS})

        def bad(k: str, why: str) -> UnitInputError:
            return UnitInputError(f"{WU_JSON}: {merged[k][0]}.{k}: {why} (got {merged[k][1]!r})")

        def positive_int(k: str) -> int:
            v = merged[k][1]
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise bad(k, "must be a positive integer")
            return v

        def number(k: str) -> float:
            v = merged[k][1]
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise bad(k, "must be a finite number")
            return float(v)

        lr, momentum = number("learning_rate"), number("momentum")
        if lr <= 0:
            raise bad("learning_rate", "must be > 0")
        if not 0.0 <= momentum < 1.0:
            raise bad("momentum", "must be in [0, 1)")
        opt, loss = merged["optimizer"][1], merged["loss"][1]
        if opt not in OPTIMIZERS:
            raise bad("optimizer", f"must be one of {', '.join(OPTIMIZERS)}")
        if not isinstance(loss, str) or not loss:
            raise bad("loss", "must be a Keras loss name")
        return cls(positive_int("batch_size"), opt, lr, momentum, positive_int("local_epochs"), loss)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_npz(path: Path, name: str, allow_empty: bool) -> tuple[np.ndarray, np.ndarray]:
    """x as float32, y as int32 (or float32 for non-integer targets), validated."""
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in ("x", "y") if k not in z.files]
            if missing:
                raise UnitInputError(f"{name}: missing array(s) {', '.join(missing)} (has {', '.join(z.files) or 'none'})")
            x, y = z["x"], z["y"]
    except UnitInputError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, KeyError) as e:
        raise UnitInputError(f"{name}: not a readable .npz file ({one_line(e)})") from None
    if x.ndim < 1 or y.ndim < 1 or len(x) != len(y):
        raise UnitInputError(f"{name}: x has {x.shape[:1]} rows and y {y.shape[:1]}; they must match")
    if not allow_empty and len(x) == 0:
        raise UnitInputError(f"{name}: no examples")
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
        raise UnitInputError(f"{name}: x has dtype {x.dtype}, expected numbers")
    if np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_:
        y = y.astype(np.int32, copy=False)
    elif np.issubdtype(y.dtype, np.floating):
        y = y.astype(np.float32, copy=False)
    else:
        raise UnitInputError(f"{name}: y has dtype {y.dtype}, expected integer labels")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise UnitInputError(f"{name}: x contains NaN or Inf")
    return x, y


def check_against_model(model: Any, name: str, x: np.ndarray, y: np.ndarray) -> None:
    want = tuple(model.inputs[0].shape[1:])
    got = x.shape[1:]
    if len(want) != len(got) or any(w is not None and w != g for w, g in zip(want, got, strict=False)):
        raise UnitInputError(f"{name}: examples have shape {got}, the model expects {want}")
    n_out = model.outputs[0].shape[-1]
    if y.dtype == np.int32 and y.ndim == 1 and y.size and n_out:
        lo, hi = int(y.min()), int(y.max())
        top = 1 if n_out == 1 else n_out - 1
        if lo < 0 or hi > top:
            raise UnitInputError(f"{name}: labels span [{lo}, {hi}], the model has {n_out} output(s)")


def read_workunit(path: Path) -> tuple[Workunit, bytes]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UnitInputError(f"{WU_JSON}: not found in the slot directory") from None
    except OSError as e:
        raise UnitInputError(f"{WU_JSON}: cannot read ({e.strerror})") from None
    try:
        wu = Workunit.from_json(raw.decode("utf-8"))
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        raise UnitInputError(f"{WU_JSON}: not a valid workunit description ({one_line(e)})") from None
    if isinstance(wu.seed, bool) or not isinstance(wu.seed, int) or wu.seed < 0:
        raise UnitInputError(f"{WU_JSON}: seed: must be a non-negative integer (got {wu.seed!r})")
    if isinstance(wu.checkpoint_every_s, bool) or not isinstance(wu.checkpoint_every_s, int | float):
        raise UnitInputError(f"{WU_JSON}: checkpoint_every_s: must be a number (got {wu.checkpoint_every_s!r})")
    for k in ("job", "unit", "model"):
        if not isinstance(getattr(wu, k), str):
            raise UnitInputError(f"{WU_JSON}: {k}: must be a string")
    return wu, raw
