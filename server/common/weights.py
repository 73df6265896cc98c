"""The weights file: HDF5 via h5py, every tensor in one flat float32 dataset.

Layout, format version 2 (written since release 0.2)::

    /                     attrs: format, format_version (2), fingerprint (JSON),
                                 fingerprint_sha, job, model, unit, base_version,
                                 examples_seen, metrics (JSON)
    /flat                 one float32 dataset of n_params values: the tensors of the
                          fingerprint, in its order, each flattened (C order)
    /optimizer/000000 ... optional (MOP): the optimizer's arrays, attr ``kind`` on the group

Format version 1 (earlier releases) kept one dataset per tensor instead of ``/flat``
(``/tensors/000000 ...``, attr ``name``); the reader accepts both, the writer writes 2
(``format_version=1`` on request). One dataset instead of hundreds is what makes a
result cheap to check: the structure checks run once, not once per tensor (a
700-tensor model: 48 ms -> a few ms per result).

The server side never imports TensorFlow: it reads a file straight into one flat
float32 buffer (the representation kept in Redis) and writes one from it. Data is
stored contiguous and uncompressed. Files come from hosts, so the reader accepts
exactly those layouts (see "reading untrusted files" below): it checks the whole
structure first, then copies the data from its byte offset in the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import stat
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from boinc_dl.server.common import h5bounds
from boinc_dl.server.common.errors import WeightsFormatError
from boinc_dl.server.common.h5bounds import BoundedSource

FORMAT = "boinc-dl-weights"
FORMAT_VERSION = 2
#: Format versions this release reads (1: one dataset per tensor; 2: one flat dataset).
READABLE_VERSIONS = (1, 2)
MAX_ATTR_BYTES = 4 << 20  # the fingerprint of a 20 000-tensor model fits
_F32 = np.dtype("<f4")


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
            from boinc_dl.server.common import bounded

            rows = bounded.loads(text, max_bytes=MAX_ATTR_BYTES, max_depth=3)
            fp = cls(tuple(TensorSpec(str(n), tuple(int(d) for d in s), str(t)) for n, s, t in rows))
            if any(d < 0 for t in fp.tensors for d in t.shape):
                raise ValueError("negative dimension")
            return fp
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


#: What a result file may hold beyond its arrays: the attributes (the fingerprint up to
#: MAX_ATTR_BYTES, the metrics up to 1 MB) and HDF5's own structures.
UPLOAD_HEADROOM_BYTES = 16 << 20
#: Float32 copies of the model a result file may hold: the weights and up to three
#: optimizer slots per variable (Adam with AMSGrad keeps three).
UPLOAD_MODEL_COPIES = 4
#: HDF5 structures per tensor in a version-1 file (object header, link), generously.
UPLOAD_BYTES_PER_TENSOR = 1024


def upload_bound(fingerprints: Fingerprint | Sequence[Fingerprint], explicit: int | None = None) -> int:
    """The bytes one result file may hold: ``explicit`` (the spec's
    ``units.max_upload_bytes``) when given, else derived from the largest model:
    ``4 * 4 * n_params + 1 KiB * n_tensors + 16 MiB`` (the weights, three optimizer
    slots, HDF5's structures, the attributes). A 19 KB model gets about 16 MB instead
    of a fixed 512 MB; the 4,972,746-parameter model of the VC-ASGD paper about 96 MB."""
    if explicit is not None:
        return int(explicit)
    fps = [fingerprints] if isinstance(fingerprints, Fingerprint) else list(fingerprints)
    need = max((4 * UPLOAD_MODEL_COPIES * fp.n_params + UPLOAD_BYTES_PER_TENSOR * len(fp.tensors) for fp in fps),
               default=0)
    return need + UPLOAD_HEADROOM_BYTES


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
    format_version: int = FORMAT_VERSION


def write_weights(path: str | Path, wf: WeightsFile, format_version: int | None = None) -> None:
    """Write a weights file atomically (temp file + rename), contiguous float32 data.

    In ``wf.format_version`` unless ``format_version`` says otherwise; 1 writes the
    earlier one-dataset-per-tensor layout (what hosts running an earlier release send)."""
    format_version = wf.format_version if format_version is None else format_version
    if format_version not in READABLE_VERSIONS:
        raise ValueError(f"format_version {format_version}: this release writes {READABLE_VERSIONS}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fp = wf.fingerprint
    if wf.flat.dtype != np.float32 or wf.flat.size != fp.n_params:
        raise WeightsFormatError(
            f"flat buffer has {wf.flat.size} {wf.flat.dtype} values, model has {fp.n_params} float32"
        )
    try:
        with h5py.File(tmp, "w", libver="latest") as f:
            f.attrs["format"] = FORMAT
            f.attrs["format_version"] = format_version
            f.attrs["fingerprint"] = fp.to_json()
            f.attrs["fingerprint_sha"] = fp.sha
            f.attrs["job"] = wf.job
            f.attrs["model"] = wf.model
            f.attrs["unit"] = wf.unit
            f.attrs["base_version"] = int(wf.base_version)
            f.attrs["examples_seen"] = int(wf.examples_seen)
            f.attrs["metrics"] = json.dumps(wf.metrics)
            if format_version == 2:
                f.create_dataset("flat", data=wf.flat, dtype="<f4")
            else:
                g = f.create_group("tensors")
                for i, (t, arr) in enumerate(zip(fp.tensors, fp.split(wf.flat), strict=True)):
                    ds = g.create_dataset(f"{i:06d}", data=arr, dtype="<f4")
                    ds.attrs["name"] = t.name
            if wf.optimizer is not None:
                og = f.create_group("optimizer")
                og.attrs["kind"] = wf.optimizer.kind
                for i, arr in enumerate(wf.optimizer.arrays):
                    og.create_dataset(f"{i:06d}", data=np.asarray(arr))
        os.replace(tmp, path)
    except BaseException:
        # A full disk (or a kill) must not leave a partial temporary copy taking its space.
        tmp.unlink(missing_ok=True)
        raise


# ---- reading untrusted files -------------------------------------------------------------
#
# A weights file comes from a host: the reader accepts exactly what write_weights writes
# and looks at the structure through h5py's low-level API before reading a byte of data.
# Links are inspected without being followed (an external link would open another file),
# datasets must keep their bytes inside this file (no external raw storage, no virtual
# dataset), without filters (write_weights writes none; a filter is a decompression bomb
# or an unknown plugin), as one name each (no hard-link alias), with the shapes and
# dtypes of the fingerprint, fully allocated (an unallocated dataset reads as fill value:
# 8 GB from a 30 KB file). Attributes are a fixed set of small scalars.
#
# What HDF5 itself reads is bounded too (see h5bounds): every read HDF5 makes while the
# structure is checked goes through a BoundedSource (at most MAX_METADATA_READ bytes at
# once, MAX_METADATA_BYTES in all), a variable-length attribute's declared length is
# checked before HDF5 reads (and zero-fills) it, and the walk over objects stops at the
# first one that cannot belong to a weights file, with link counts bounded before any
# path is built. The cost of rejecting a file is then bounded by what was checked.

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
ROOT_ATTRS = frozenset({"format", "format_version", "fingerprint", "fingerprint_sha", "job", "model", "unit",
                        "base_version", "examples_seen", "metrics", "layout"})
MAX_METRICS_ATTR_BYTES = 1 << 20
#: One read HDF5 makes of the file's metadata: an attribute and its heap's header fit.
MAX_METADATA_READ = MAX_ATTR_BYTES + (64 << 10)
#: All metadata HDF5 reads before the data (a 20 000-tensor version-1 file reads 22.4 MB,
#: the 700-tensor model of the VC-ASGD paper 0.4 MB). With the search of it for
#: attribute messages and one attribute, a rejected file costs at most ~60 MiB.
MAX_METADATA_BYTES = 24 << 20
_UNDEFINED_ADDRESS = (1 << 64) - 1
_LAYOUTS = (h5py.h5d.CONTIGUOUS, h5py.h5d.CHUNKED, h5py.h5d.COMPACT)


def _check_file(path: Path, max_bytes: int | None) -> int:
    """File-level checks before HDF5 sees the file; returns its size.

    A regular file within the upload bound, HDF5 signature at offset 0 (no user block,
    in which anything could hide), superblock version 2 or 3 as ``libver="latest"``
    writes (versions 0/1 carry a driver-info block: family/multi/split drivers), no
    consistency flags set (a file still open for writing or SWMR), 8-byte addresses and
    lengths, base address 0, no superblock extension (shared-message tables, file-space
    settings: write_weights writes none), and an end-of-file address within the file, so
    that no address HDF5 follows lies beyond the bytes the host sent.
    """
    try:
        # Follows a symbolic link (a client's input files are links into its cache);
        # result files are refused as links before they get here (validator, scripts).
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise WeightsFormatError("not a regular file (a device, a pipe?)")
        if max_bytes is not None and st.st_size > max_bytes:
            raise WeightsFormatError(f"{st.st_size} bytes, over the {max_bytes}-byte bound")
        with path.open("rb") as fh:
            head = fh.read(48)
    except OSError as e:
        raise WeightsFormatError(f"cannot read ({e.strerror})") from None
    if head[:8] != HDF5_MAGIC:
        raise WeightsFormatError("no HDF5 signature at offset 0 (not HDF5, or a user block)")
    if len(head) < 12 or head[8] not in (2, 3):
        raise WeightsFormatError(f"HDF5 superblock version {head[8] if len(head) > 8 else '?'} "
                                 "(boinc-dl writes version 2/3 only)")
    if head[11] != 0:
        raise WeightsFormatError("HDF5 file is marked open for writing (or SWMR)")
    if len(head) < 48 or head[9] != 8 or head[10] != 8:
        raise WeightsFormatError("HDF5 superblock truncated or not of 8-byte addresses")
    base, ext, eof, _root = struct.unpack_from("<4Q", head, 12)
    if base != 0 or ext != _UNDEFINED_ADDRESS:
        raise WeightsFormatError("HDF5 superblock with a base address or an extension (boinc-dl writes neither)")
    if eof > st.st_size:
        raise WeightsFormatError(f"not a readable HDF5 weights file (truncated: its end-of-file address is {eof}, "
                                 f"the file has {st.st_size} bytes)")
    return st.st_size


@contextlib.contextmanager
def _open(path: Path, size: int) -> Iterator[tuple[h5py.File, BoundedSource]]:
    """The file opened by HDF5 through a :class:`BoundedSource` (read-only, the default
    ``fileobj`` driver: never family/split), closed in order (HDF5 first)."""
    with path.open("rb") as fh:
        src = BoundedSource(fh, size, MAX_METADATA_READ, MAX_METADATA_BYTES)
        f = h5py.File(src, "r")
        try:
            yield f, src
        finally:
            f.close()


class _Attrs:
    """Reads attributes of one file with the bytes they will occupy checked first."""

    def __init__(self, src: BoundedSource):
        self.src = src
        self._meta: bytearray | None = None

    def refresh(self) -> None:
        """Forget the metadata snapshot (attribute messages read since are searched too)."""
        self._meta = None

    def vlen_bytes(self, name: str) -> int:
        if self._meta is None:
            self._meta = self.src.metadata()
            if h5bounds.filtered_heaps(self._meta):
                raise WeightsFormatError("its metadata heap is filtered (compressed); boinc-dl writes none")
        try:
            return h5bounds.vlen_bytes(self._meta, name)
        except h5bounds.UncheckableAttribute as e:
            raise WeightsFormatError(f"attribute {name!r} cannot be checked: {e}") from None

    def get(self, obj: Any, name: str, max_bytes: int = MAX_ATTR_BYTES, scalar: bool = True) -> Any:
        """One attribute's value, its shape, type and size (the bytes it will occupy once
        read, a variable-length string's included) checked before it is read; None if absent."""
        if not h5py.h5a.exists(obj, name.encode()):
            return None
        a = h5py.h5a.open(obj, name.encode())
        if scalar and a.shape != ():
            raise WeightsFormatError(f"attribute {name!r} is not a scalar")
        dt = a.dtype
        if dt.kind not in "iufSO" or (dt.kind == "O" and h5py.check_string_dtype(dt) is None):
            raise WeightsFormatError(f"attribute {name!r} has type {dt}")
        # A variable-length string is the only kind let through whose bytes are not its storage.
        size = self.vlen_bytes(name) if dt.kind == "O" else a.get_storage_size()
        if size > max_bytes:
            raise WeightsFormatError(f"attribute {name!r} is over {max_bytes} bytes ({size} declared)")
        out = np.empty(a.shape, dtype=dt)
        a.read(out)
        return out[()] if out.shape == () else out

    def str(self, obj: Any, name: str, default: str = "", max_bytes: int = MAX_ATTR_BYTES) -> str:
        v = self.get(obj, name, max_bytes)
        if v is None:
            return default
        if isinstance(v, bytes):
            try:
                return v.decode()
            except UnicodeDecodeError:
                raise WeightsFormatError(f"attribute {name!r} is not UTF-8") from None
        if isinstance(v, str):
            return v
        raise WeightsFormatError(f"attribute {name!r} is not a string")

    def int(self, obj: Any, name: str) -> int:
        v = self.get(obj, name, 16)
        if v is None:
            return 0
        if not isinstance(v, np.integer | int):
            raise WeightsFormatError(f"attribute {name!r} is not an integer")
        return int(v)


def _check_attr_names(obj: Any, allowed: frozenset[str], what: str) -> None:
    n = h5py.h5a.get_num_attrs(obj)
    if n > len(allowed):
        raise WeightsFormatError(f"{what} has {n} attributes")
    for i in range(n):
        name = h5py.h5a.open(obj, index=i).name
        name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        if name not in allowed:
            raise WeightsFormatError(f"{what} has an unexpected attribute {name[:40]!r}")


def _members(g: Any, what: str, max_links: int) -> list[str]:
    """The names in a group, all hard links (soft, external and user-defined links are
    listed, never followed), at most ``max_links`` of them (counted before any name is
    read). One C-level iteration, not one call per member."""
    n = g.get_num_objs()
    if n > max_links:
        raise WeightsFormatError(f"{what or 'the file'} holds {n} objects, at most {max_links} expected")
    names: list[str] = []
    bad: list[str] = []

    def link(name: bytes, info: Any) -> int | None:
        (names if info.type == h5py.h5l.TYPE_HARD else bad).append(name.decode(errors="replace"))
        return 0 if bad else None

    g.links.iterate(link, info=True)
    if bad:
        raise WeightsFormatError(f"{what}/{bad[0][:40]} is a soft, external or user-defined link")
    return names


def _objects(root: Any, groups: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Every object of the file: {path: (object type, attribute count)}, each linked once
    (no second name for one object).

    ``groups``: the top-level groups the file may hold and the links each may hold.
    Their link counts are checked before the walk, and the walk stops at the first
    object that cannot belong to a weights file: one below depth 2, a group inside a
    group, a group where a dataset belongs. A file nested 20 000 deep is refused at
    its first level, not walked (the full walk was quadratic in the depth).
    """
    for name, max_links in groups.items():
        if h5py.h5o.get_info(root, name.encode()).type != h5py.h5o.TYPE_GROUP:
            raise WeightsFormatError(f"/{name} is not a group")
        _members(h5py.h5g.open(root, name.encode()), f"/{name}", max_links)
    objs: dict[str, tuple[int, int]] = {}
    bad: list[str] = []

    def obj(name: bytes, info: Any) -> int | None:
        path = name.decode(errors="replace")
        if path == ".":
            return None
        top, _, rest = path.partition("/")
        if info.rc != 1:
            bad.append(f"/{path[:40]} is linked under more than one name")
        elif "/" in rest or (rest and top not in groups):
            bad.append(f"/{path[:40]} is nested deeper than a weights file's objects")
        elif info.type not in (h5py.h5o.TYPE_GROUP, h5py.h5o.TYPE_DATASET):
            bad.append(f"/{path[:40]} is neither a group nor a dataset")
        elif info.type == h5py.h5o.TYPE_GROUP and (rest or top not in groups):
            bad.append(f"/{path[:40]} is a group where a dataset belongs")
        if bad:
            return 0  # stop the walk here
        objs[path] = (info.type, info.num_attrs)
        return None

    h5py.h5o.visit(root, obj, info=True)
    if bad:
        raise WeightsFormatError(bad[0])
    return objs


def _group(parent: Any, name: str, what: str, objs: dict[str, tuple[int, int]]) -> Any:
    if objs[name][0] != h5py.h5o.TYPE_GROUP:
        raise WeightsFormatError(f"{what} is not a group")
    return h5py.h5g.open(parent, name.encode())


@dataclass
class _Dataset:
    """A checked dataset, ready to be read into a buffer of ``shape``/``dtype``."""

    id: Any
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int | None  # byte offset in the file when contiguous


def _dataset(g: Any, name: str, what: str, file_size: int, shape: tuple[int, ...] | None,
             member: tuple[int, int], kinds: str = "f", max_attrs: int = 1) -> _Dataset:
    """Open and check one dataset without reading it (see the section comment).

    ``member``: its (object type, attribute count) from :func:`_objects`; ``max_attrs``:
    how many attributes it may carry (a v1 tensor its "name", which is never read)."""
    if member[0] != h5py.h5o.TYPE_DATASET:
        raise WeightsFormatError(f"{what} is not a dataset")
    if member[1] > max_attrs:
        raise WeightsFormatError(f"{what} has unexpected attributes")
    d = h5py.h5d.open(g, name.encode())
    dcpl = d.get_create_plist()
    layout = dcpl.get_layout()
    if layout not in _LAYOUTS:
        raise WeightsFormatError(f"{what} is a virtual dataset (or of an unknown layout {layout})")
    if dcpl.get_external_count():
        raise WeightsFormatError(f"{what} keeps its data in external files")
    if dcpl.get_nfilters():
        raise WeightsFormatError(f"{what} is filtered (compressed); boinc-dl writes no filters")
    space = d.get_space()
    if space.get_simple_extent_type() not in (h5py.h5s.SIMPLE, h5py.h5s.SCALAR):
        raise WeightsFormatError(f"{what} has a null dataspace")
    got = tuple(int(x) for x in space.shape)
    if shape is not None and got != shape:
        raise WeightsFormatError(f"{what}: stored shape {got} != {shape}")
    if kinds == "f":
        # Compared as HDF5 types: cheaper than a numpy dtype, and stricter (precision,
        # padding and byte order included).
        if not d.get_type().equal(h5py.h5t.IEEE_F32LE):
            raise WeightsFormatError(f"{what}: stored type is not little-endian float32")
        dt = _F32
    else:
        try:
            dt = d.dtype
        except (TypeError, ValueError):
            raise WeightsFormatError(f"{what} has an unsupported data type") from None
        if dt.kind not in kinds or dt.itemsize > 8 or dt.byteorder == ">":
            raise WeightsFormatError(f"{what}: dtype {dt} is not numeric")
    nbytes = math.prod(got) * dt.itemsize
    if nbytes > file_size:
        raise WeightsFormatError(f"{what} declares {nbytes} bytes in a file of {file_size}")
    stored = d.get_storage_size()
    if stored < nbytes:
        raise WeightsFormatError(f"{what} has {stored} of its {nbytes} bytes stored (fill values)")
    offset = None
    if layout == h5py.h5d.CONTIGUOUS:
        offset = d.get_offset()
        if nbytes and (offset is None or offset < 0 or offset + nbytes > file_size):
            raise WeightsFormatError(f"{what}: data outside the file")
    elif layout == h5py.h5d.CHUNKED:
        chunk = dcpl.get_chunk()
        if len(chunk) != len(got) or any(c > max(s, 1) for c, s in zip(chunk, got, strict=True)):
            raise WeightsFormatError(f"{what}: chunks {chunk} larger than the dataset {got}")
    if stored > file_size:
        raise WeightsFormatError(f"{what} stores {stored} bytes in a file of {file_size}")
    return _Dataset(d, got, dt, offset)


def _read_into(fh: Any, ds: _Dataset, dst: np.ndarray) -> None:
    """Fill ``dst`` (the dataset's element count, its dtype) from a checked dataset."""
    if not dst.size:
        return
    if ds.offset is not None and dst.dtype == ds.dtype:
        fh.seek(ds.offset)
        view = memoryview(dst.reshape(-1)).cast("B")
        if fh.readinto(view) != view.nbytes:
            raise WeightsFormatError("file truncated")
    else:
        ds.id.read(h5py.h5s.ALL, h5py.h5s.ALL, dst.reshape(ds.shape) if ds.shape else dst.reshape(()))


class _Reading:
    """Turns anything an untrusted file makes the reader raise into :class:`WeightsFormatError`
    naming the file (never an h5py exception); a read the bounds refused is named as such."""

    def __init__(self, path: Path):
        self.path = path
        self.src: BoundedSource | None = None

    def __enter__(self) -> _Reading:
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: object) -> bool:
        if e is None:
            return False
        if isinstance(e, WeightsFormatError):
            raise WeightsFormatError(f"{self.path.name}: {e}") from None
        if isinstance(e, OSError | KeyError | ValueError | TypeError | RuntimeError):
            why = self.src.refused if self.src is not None and self.src.refused else e
            raise WeightsFormatError(f"{self.path.name}: not a readable HDF5 weights file ({why})") from None
        return False


def read_header(path: str | Path, max_bytes: int | None = None) -> WeightsFile:
    """Read only the metadata of a weights file (``flat`` is an empty array)."""
    path = Path(path)
    with _Reading(path) as guard:
        size = _check_file(path, max_bytes)
        with _open(path, size) as (f, guard.src):
            return _header(h5py.h5g.open(f.id, b"/"), _Attrs(guard.src))


def _header(root: Any, attrs: _Attrs, expected: Fingerprint | None = None) -> WeightsFile:
    from boinc_dl.server.common import bounded

    _check_attr_names(root, ROOT_ATTRS, "the file")
    if attrs.str(root, "format") != FORMAT:
        raise WeightsFormatError("not a boinc-dl weights file (format attribute missing)")
    version = attrs.int(root, "format_version")
    if version not in READABLE_VERSIONS:
        raise WeightsFormatError(f"format_version {version} (this release reads {READABLE_VERSIONS})")
    try:
        metrics = bounded.loads(attrs.str(root, "metrics", "{}", MAX_METRICS_ATTR_BYTES), MAX_METRICS_ATTR_BYTES)
    except ValueError as e:
        raise WeightsFormatError(f"metrics attribute is not bounded JSON ({e})") from None
    if not isinstance(metrics, dict):
        raise WeightsFormatError("metrics attribute is not a JSON object")
    return WeightsFile(
        flat=np.empty(0, np.float32),
        fingerprint=_fingerprint_attr(attrs.str(root, "fingerprint", "[]"), expected),
        job=attrs.str(root, "job"),
        model=attrs.str(root, "model", "0"),
        unit=attrs.str(root, "unit"),
        base_version=attrs.int(root, "base_version"),
        examples_seen=attrs.int(root, "examples_seen"),
        metrics=metrics,
        format_version=version,
    )


def _fingerprint_attr(text: str, expected: Fingerprint | None) -> Fingerprint:
    # What write_weights wrote for the expected model, byte for byte: no parse needed.
    if expected is not None and text == expected.to_json():
        return expected
    return Fingerprint.from_json(text)


def _max_optimizer_arrays(fp: Fingerprint) -> int:
    # Slots (Adam: 2 per variable) plus a step counter: bounded by the model's size.
    return 4 * len(fp.tensors) + 16


def read_weights(path: str | Path, expected: Fingerprint | None = None, max_bytes: int | None = None) -> WeightsFile:
    """Read a weights file into one flat float32 buffer.

    With ``expected``, the file's tensors (count, names, shapes, dtypes) must match it
    exactly; the error says which tensor differs. ``max_bytes`` bounds the file size.
    The whole structure is checked (see above) before anything is allocated or read,
    and what HDF5 reads meanwhile is bounded; any unreadable, truncated or hostile file
    raises :class:`WeightsFormatError`, never an h5py exception.
    """
    path = Path(path)
    with _Reading(path) as guard:
        size = _check_file(path, max_bytes)
        with _open(path, size) as (f, src), path.open("rb") as fh:
            guard.src = src
            root = h5py.h5g.open(f.id, b"/")
            attrs = _Attrs(src)
            wf = _header(root, attrs, expected)
            fp = wf.fingerprint
            if expected is not None:
                _check_fingerprint(fp, expected)
                fp = wf.fingerprint = expected
            if 4 * fp.n_params > size:
                raise WeightsFormatError(f"fingerprint declares {fp.n_params} values in a file of {size} bytes")
            names = _members(root, "", 2)
            data = "flat" if wf.format_version == 2 else "tensors"
            if not set(names) <= {data, "optimizer"} or data not in names:
                raise WeightsFormatError(f"unexpected top-level objects {sorted(names)[:5]} for format "
                                         f"version {wf.format_version} (/{data} expected)")
            groups = {"tensors": len(fp.tensors)} if data == "tensors" else {}
            if "optimizer" in names:
                groups["optimizer"] = _max_optimizer_arrays(fp)
            objs = _objects(root, groups)
            tensors, optimizer = _checked_datasets(root, fp, size, "optimizer" in names, objs, wf.format_version,
                                                   attrs)
            with src.unlimited():  # every size below has been checked against the file
                flat = np.empty(fp.n_params, dtype=np.float32)
                if wf.format_version == 2:
                    _read_into(fh, tensors[0], flat)
                else:
                    off = 0
                    for ds, t in zip(tensors, fp.tensors, strict=True):
                        _read_into(fh, ds, flat[off : off + t.size])
                        off += t.size
                wf.flat = flat
                if optimizer is not None:
                    kind, dss = optimizer
                    arrays = []
                    for ds in dss:
                        a = np.empty(ds.shape, ds.dtype)
                        _read_into(fh, ds, a)
                        arrays.append(a)
                    wf.optimizer = OptimizerState(kind, arrays)
            return wf


def _checked_datasets(root: Any, fp: Fingerprint, size: int, has_optimizer: bool,
                      objs: dict[str, tuple[int, int]], version: int, attrs: _Attrs
                      ) -> tuple[list[_Dataset], tuple[str, list[_Dataset]] | None]:
    """Every dataset of the file checked against ``fp`` and the file size, none read:
    ``/flat`` (version 2) or one per tensor (version 1), and the optimizer's.

    The optimizer state first: a few datasets, so a bad one is refused before the
    hundreds of tensor headers of a version-1 file are opened.
    """
    optimizer = _checked_optimizer(root, fp, size, objs, attrs) if has_optimizer else None
    if version == 2:
        return [_dataset(root, "flat", "/flat", size, (fp.n_params,), objs["flat"], max_attrs=0)], optimizer
    g = _group(root, "tensors", "/tensors", objs)
    _check_attr_names(g, frozenset(), "/tensors")
    names = sorted(_members(g, "/tensors", len(fp.tensors)))
    want = [f"{i:06d}" for i in range(len(fp.tensors))]
    if names != want:
        raise WeightsFormatError(f"file holds {len(names)} tensors named {names[:3]}..., its fingerprint "
                                 f"lists {len(fp.tensors)}")
    tensors = [_dataset(g, k, f"tensor {t.name}", size, t.shape, objs[f"tensors/{k}"])
               for k, t in zip(want, fp.tensors, strict=True)]
    return tensors, optimizer


def _checked_optimizer(root: Any, fp: Fingerprint, size: int, objs: dict[str, tuple[int, int]],
                       attrs: _Attrs) -> tuple[str, list[_Dataset]]:
    og = _group(root, "optimizer", "/optimizer", objs)
    _check_attr_names(og, frozenset({"kind"}), "/optimizer")
    attrs.refresh()  # its attribute message was read after the root's
    kind = attrs.str(og, "kind", max_bytes=256)
    onames = sorted(_members(og, "/optimizer", _max_optimizer_arrays(fp)))
    dss, total = [], 0
    for k in onames:
        ds = _dataset(og, k, f"optimizer array {k[:40]}", size, None, objs[f"optimizer/{k}"], kinds="fiu")
        total += math.prod(ds.shape)
        if total > 4 * fp.n_params + 16:
            raise WeightsFormatError(f"optimizer state has over {total} values for a model of {fp.n_params}")
        dss.append(ds)
    return kind, dss


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
