"""The weights file: HDF5 via h5py, one dataset per tensor in a fixed order.

Layout::

    /                     attrs: format, format_version, fingerprint (JSON), fingerprint_sha,
                                 job, model, unit, base_version, examples_seen, metrics (JSON)
    /tensors/000000 ...   one float32 dataset per tensor, attr ``name``

The server side never imports TensorFlow: it reads a file straight into one flat
float32 buffer (the representation kept in Redis) and writes one from it.
Tensors are stored contiguous and uncompressed, so the reader can copy them out
of a single ``read()`` of the file by their byte offsets (fast path); chunked or
compressed files from other writers are still read through h5py (slow path).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from server.common.errors import WeightsFormatError

FORMAT = "boinc-dl-weights"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one model tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @cached_property
    def size(self) -> int:
        # math.prod on a tuple of ints: np.prod costs ~6 us a call, and a 700-tensor
        # model asks thousands of times per result (measured: 22 ms per assimilation).
        return math.prod(self.shape)


@dataclass(frozen=True)
class Fingerprint:
    """The model's identity for weights files: its tensors, in order."""

    tensors: tuple[TensorSpec, ...]

    @cached_property
    def n_params(self) -> int:
        return sum(t.size for t in self.tensors)

    def to_json(self) -> str:
        return json.dumps([[t.name, list(t.shape), t.dtype] for t in self.tensors], separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Fingerprint:
        try:
            rows = json.loads(text)
            return cls(tuple(TensorSpec(str(n), tuple(int(d) for d in s), str(t)) for n, s, t in rows))
        except (ValueError, TypeError) as e:
            raise WeightsFormatError(f"malformed model fingerprint: {e}") from None

    @property
    def sha(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def split(self, flat: np.ndarray) -> list[np.ndarray]:
        """Views of ``flat`` shaped as the model's tensors."""
        out, off = [], 0
        for t in self.tensors:
            out.append(flat[off : off + t.size].reshape(t.shape))
            off += t.size
        return out

    def flatten(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """One float32 buffer from a list of tensors (checked against the fingerprint)."""
        if len(arrays) != len(self.tensors):
            raise WeightsFormatError(f"expected {len(self.tensors)} tensors, got {len(arrays)}")
        flat = np.empty(self.n_params, dtype=np.float32)
        off = 0
        for t, a in zip(self.tensors, arrays, strict=True):
            a = np.asarray(a)
            if tuple(a.shape) != t.shape:
                raise WeightsFormatError(f"tensor {t.name}: shape {a.shape} != {t.shape}")
            flat[off : off + t.size] = a.reshape(-1)
            off += t.size
        return flat


def fingerprint_of(names: Sequence[str], arrays: Sequence[np.ndarray]) -> Fingerprint:
    """Build a fingerprint from tensor names and arrays (e.g. a Keras model's weights)."""
    return Fingerprint(
        tuple(TensorSpec(str(n), tuple(int(d) for d in np.shape(a)), "float32") for n, a in zip(names, arrays, strict=True))
    )


@dataclass
class OptimizerState:
    """An optimizer's variables (slots and step counter), carried with MOP weights so
    that a model hopping between partitions keeps its optimizer state, as in sequential
    training. Matched by order and shape on load; the learning rate is not included."""

    kind: str
    arrays: list[np.ndarray]

    def to_bytes(self, version: int) -> bytes:
        """Serialise (numpy's npz, no pickle) tagged with the weights version it belongs to."""
        import io

        buf = io.BytesIO()
        meta = json.dumps({"kind": self.kind, "version": int(version)}).encode()
        np.savez(buf, __meta__=np.frombuffer(meta, np.uint8), **{f"v{i:04d}": a for i, a in enumerate(self.arrays)})
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, blob: bytes) -> tuple[OptimizerState, int]:
        import io

        with np.load(io.BytesIO(blob), allow_pickle=False) as z:
            meta = json.loads(z["__meta__"].tobytes())
            arrays = [z[k] for k in sorted(z.files) if k != "__meta__"]
        return cls(str(meta["kind"]), arrays), int(meta["version"])


@dataclass
class WeightsFile:
    """A weights file's contents: flat buffer plus metadata."""

    flat: np.ndarray
    fingerprint: Fingerprint
    job: str = ""
    model: str = "0"
    unit: str = ""
    base_version: int = 0
    examples_seen: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    optimizer: OptimizerState | None = None


def write_weights(path: str | Path, wf: WeightsFile) -> None:
    """Write a weights file atomically (temp file + rename), contiguous float32 tensors."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fp = wf.fingerprint
    if wf.flat.dtype != np.float32 or wf.flat.size != fp.n_params:
        raise WeightsFormatError(
            f"flat buffer has {wf.flat.size} {wf.flat.dtype} values, model has {fp.n_params} float32"
        )
    with h5py.File(tmp, "w", libver="latest") as f:
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["fingerprint"] = fp.to_json()
        f.attrs["fingerprint_sha"] = fp.sha
        f.attrs["job"] = wf.job
        f.attrs["model"] = wf.model
        f.attrs["unit"] = wf.unit
        f.attrs["base_version"] = int(wf.base_version)
        f.attrs["examples_seen"] = int(wf.examples_seen)
        f.attrs["metrics"] = json.dumps(wf.metrics)
        g = f.create_group("tensors")
        layout = []
        for i, (t, arr) in enumerate(zip(fp.tensors, fp.split(wf.flat), strict=True)):
            ds = g.create_dataset(f"{i:06d}", data=arr, dtype="<f4")
            ds.attrs["name"] = t.name
            layout.append(ds.id.get_offset())
        # Byte offsets of the (contiguous, float32) tensors: lets a reader copy them out
        # of the file without opening 700 dataset headers. Only a shortcut: a file
        # without it (or with one that does not fit) is read through the datasets.
        if all(o is not None for o in layout):
            f.attrs["layout"] = np.asarray(layout, dtype=np.int64)
        if wf.optimizer is not None:
            og = f.create_group("optimizer")
            og.attrs["kind"] = wf.optimizer.kind
            for i, arr in enumerate(wf.optimizer.arrays):
                og.create_dataset(f"{i:06d}", data=np.asarray(arr))
    os.replace(tmp, path)


def _attr_str(f: h5py.File | h5py.Group, key: str, default: str = "") -> str:
    v = f.attrs.get(key, default)
    return v.decode() if isinstance(v, bytes) else str(v)


def read_header(path: str | Path) -> WeightsFile:
    """Read only the metadata of a weights file (``flat`` is an empty array)."""
    try:
        with h5py.File(path, "r") as f:
            return _header(f)
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as e:
        raise WeightsFormatError(f"{Path(path).name}: not a readable weights file ({e})") from None


def _header(f: h5py.File) -> WeightsFile:
    if _attr_str(f, "format") != FORMAT:
        raise WeightsFormatError("not a boinc-dl weights file (format attribute missing)")
    try:
        metrics = json.loads(_attr_str(f, "metrics", "{}"))
    except ValueError:
        raise WeightsFormatError("metrics attribute is not JSON") from None
    if not isinstance(metrics, dict):
        raise WeightsFormatError("metrics attribute is not a JSON object")
    return WeightsFile(
        flat=np.empty(0, np.float32),
        fingerprint=Fingerprint.from_json(_attr_str(f, "fingerprint", "[]")),
        job=_attr_str(f, "job"),
        model=_attr_str(f, "model", "0"),
        unit=_attr_str(f, "unit"),
        base_version=int(f.attrs.get("base_version", 0)),
        examples_seen=int(f.attrs.get("examples_seen", 0)),
        metrics=metrics,
    )


def read_weights(path: str | Path, expected: Fingerprint | None = None) -> WeightsFile:
    """Read a weights file into one flat float32 buffer.

    With ``expected``, the file's tensors (count, names, shapes, dtypes) must match it
    exactly; the error says which tensor differs. Any unreadable or truncated file
    raises :class:`WeightsFormatError`, never an h5py exception.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise WeightsFormatError(f"{path.name}: cannot read ({e.strerror})") from None
    try:
        with h5py.File(path, "r") as f:
            wf = _header(f)
            fp = wf.fingerprint
            if expected is not None:
                _check_fingerprint(fp, expected)
            g = f.get("tensors")
            if not isinstance(g, h5py.Group):
                raise WeightsFormatError("no 'tensors' group")
            flat = _read_by_layout(f, fp, raw)
            if flat is None:
                flat = _read_tensors(g, fp, raw)
            wf.flat = flat
            og = f.get("optimizer")
            if isinstance(og, h5py.Group):
                arrays = [np.asarray(og[k][()]) for k in sorted(og.keys())]
                if any(a.dtype.kind not in "fiu" for a in arrays):
                    raise WeightsFormatError("optimizer state holds non-numeric data")
                wf.optimizer = OptimizerState(_attr_str(og, "kind"), arrays)
            return wf
    except WeightsFormatError as e:
        raise WeightsFormatError(f"{path.name}: {e}") from None
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as e:
        raise WeightsFormatError(f"{path.name}: not a readable HDF5 weights file ({e})") from None


_F32 = np.dtype("<f4")


def _read_by_layout(f: h5py.File, fp: Fingerprint, raw: bytes) -> np.ndarray | None:
    """The fast path: copy tensors from the file bytes at the offsets the writer recorded.

    None when the file has no usable layout (another writer, or offsets that do not fit
    the file): the caller then reads through the datasets. A layout that lies can only
    make the file's own weights garbage, which a bad client could send anyway; the
    validator's finiteness and distance checks still apply.
    """
    layout = f.attrs.get("layout")
    g = f.get("tensors")
    if layout is None or not isinstance(g, h5py.Group):
        return None
    layout = np.asarray(layout)
    if layout.ndim != 1 or layout.dtype.kind not in "iu" or len(layout) != len(fp.tensors):
        return None
    layout = layout.astype(np.int64)
    # Spot-check the recorded offsets against the datasets themselves (first, last and two
    # random ones): a layout attribute copied into another file by a tool that moved the
    # data (h5repack, a copy) is caught here and the file is read the slow way.
    n = len(fp.tensors)
    for i in {0, n - 1, *random.sample(range(n), min(2, n))}:
        try:
            d = h5py.h5d.open(g.id, f"{i:06d}".encode())
        except KeyError:
            return None
        if d.get_offset() != int(layout[i]) or tuple(d.shape) != fp.tensors[i].shape or d.dtype != _F32:
            return None
    flat = np.empty(fp.n_params, dtype=np.float32)
    off = 0
    for start, t in zip(layout.tolist(), fp.tensors, strict=True):
        if start < 0 or start + 4 * t.size > len(raw):
            return None
        flat[off : off + t.size] = np.frombuffer(raw, dtype=_F32, count=t.size, offset=start)
        off += t.size
    return flat


def _read_tensors(g: h5py.Group, fp: Fingerprint, raw: bytes) -> np.ndarray:
    """Copy every tensor into one flat buffer, checking count, shapes and dtypes.

    Uses h5py's low-level dataset API (5x faster than ``g[name]`` for hundreds of
    tensors) and, for contiguous datasets, copies straight from the file's bytes.
    """
    names = sorted(n.decode() if isinstance(n, bytes) else n for n in g.id.__iter__())
    if len(names) != len(fp.tensors):
        raise WeightsFormatError(f"file holds {len(names)} tensors, its fingerprint lists {len(fp.tensors)}")
    flat = np.empty(fp.n_params, dtype=np.float32)
    off = 0
    for key, t in zip(names, fp.tensors, strict=True):
        d = h5py.h5d.open(g.id, key.encode())
        if tuple(d.shape) != t.shape:
            raise WeightsFormatError(f"tensor {t.name}: stored shape {d.shape} != {t.shape}")
        if d.dtype != _F32:
            raise WeightsFormatError(f"tensor {t.name}: dtype {d.dtype} is not float32")
        dst = flat[off : off + t.size]
        start = d.get_offset()  # None unless contiguous and allocated
        if start is not None and start + 4 * t.size <= len(raw):
            dst[:] = np.frombuffer(raw, dtype=_F32, count=t.size, offset=start)
        elif t.size:
            d.read(h5py.h5s.ALL, h5py.h5s.ALL, dst.reshape(t.shape) if t.shape else dst.reshape(()))
        off += t.size
    return flat


def check_fingerprint(got: Fingerprint, want: Fingerprint) -> None:
    """Raise :class:`WeightsFormatError` naming the first tensor that differs."""
    _check_fingerprint(got, want)


def _check_fingerprint(got: Fingerprint, want: Fingerprint) -> None:
    if len(got.tensors) != len(want.tensors):
        raise WeightsFormatError(f"model has {len(want.tensors)} tensors, file has {len(got.tensors)}")
    for g, w in zip(got.tensors, want.tensors, strict=True):
        if g.name != w.name:
            raise WeightsFormatError(f"tensor name {g.name!r} where the model has {w.name!r}")
        if g.shape != w.shape:
            raise WeightsFormatError(f"tensor {w.name}: shape {g.shape} != model's {w.shape}")
        if g.dtype != w.dtype:
            raise WeightsFormatError(f"tensor {w.name}: dtype {g.dtype} != model's {w.dtype}")
