"""A corpus of hostile result files: each builder writes one attack on the result path.

Weights files start from a valid file of ``write_weights`` (format version 2, one
``/flat`` dataset, and version 1, one dataset per tensor, which hosts of an earlier
release send; the attacks on version 2 are named ``...-v2``) and change one thing the
way a hostile host would: data stored outside the file (external raw storage, external
links, virtual datasets pointing at a server file), links (soft, hard-link aliases),
filters, declared sizes far beyond the file (unallocated datasets read as fill value),
wrong dtypes, truncation, a user block, other superblocks and drivers, extra objects
and attributes. Also hostile metrics files (deep nesting, size, encoding) and gzip
bombs. Used by tests/test_hostile_results.py and bench/bench_hostile.py.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from boinc_dl.server.common.weights import Fingerprint, OptimizerState, WeightsFile, write_weights

SECRET = b"redis_url: redis://:hunter2-the-password@127.0.0.1:6379/0\n"
HUGE = 2_000_000_000  # values a tiny file declares


@dataclass(frozen=True)
class Attack:
    """One hostile weights file: how to build it and what the rejection must say."""

    name: str
    build: Callable[[Path, Fingerprint, str, str, Path], None]  # (path, fp, job, unit, secret dir)
    reason: str  # a substring of the rejection reason


def secret_files(d: Path, n_values: int) -> tuple[Path, Path]:
    """A server file holding a secret (raw bytes, ``n_values`` float32's worth) and an
    HDF5 file on the server holding it as a dataset named ``data``."""
    d.mkdir(parents=True, exist_ok=True)
    raw = d / "boinc-dl.yaml"
    raw.write_bytes((SECRET * (4 * n_values // len(SECRET) + 1))[: 4 * n_values])
    h5 = d / "server.h5"
    with h5py.File(h5, "w", libver="latest") as f:
        f.create_dataset("data", data=np.frombuffer(raw.read_bytes(), "<f4"))
    return raw, h5


def valid(path: Path, fp: Fingerprint, job: str, unit: str, optimizer: bool = False, version: int = 2) -> None:
    """What an honest host sends (``version=1``: a host of an earlier release)."""
    flat = np.random.default_rng(0).normal(0, 0.1, fp.n_params).astype(np.float32)
    opt = OptimizerState("adam", [np.zeros(fp.n_params, np.float32), np.asarray(3, np.int64)]) if optimizer else None
    write_weights(path, WeightsFile(flat, fp, job=job, model="0", unit=unit, base_version=0, examples_seen=10,
                                    metrics={"val_acc": 0.5}, optimizer=opt), format_version=version)


def _edit(fn: Callable[[h5py.File, Fingerprint, Path], None],
          version: int = 1) -> Callable[[Path, Fingerprint, str, str, Path], None]:
    """A builder: a valid file of ``version``, then ``fn(file, fp, secret_dir)`` on it
    opened for writing."""
    def build(path: Path, fp: Fingerprint, job: str, unit: str, sd: Path) -> None:
        valid(path, fp, job, unit, version=version)
        with h5py.File(path, "a") as f:
            fn(f, fp, sd)
    return build


def _replace(f: h5py.File, fp: Fingerprint, i: int = 0) -> tuple[h5py.Group, str, tuple[int, ...]]:
    """Remove the dataset an attack replaces: a tensor of a version-1 file (``i``; -1:
    the last, found after all the others), ``/flat`` of a version-2 file. Returns its
    group, name and shape."""
    if "flat" in f:
        del f["flat"]
        return f, "flat", (fp.n_params,)
    key = f"{i % len(f['tensors']):06d}"
    del f["tensors"][key]
    return f["tensors"], key, fp.tensors[i].shape


def _data(f: h5py.File) -> h5py.Dataset:
    """The data a version-1 (tensor 1) or version-2 (``/flat``) file holds."""
    return f["flat"] if "flat" in f else f["tensors"]["000001"]


def _external_storage(f: h5py.File, fp: Fingerprint, sd: Path) -> None:
    raw, _ = secret_files(sd, fp.n_params)
    g, k, shape = _replace(f, fp)
    g.create_dataset(k, shape=shape, dtype="<f4", external=[(str(raw), 0, 4 * math.prod(shape))])


def _external_link(f: h5py.File, fp: Fingerprint, sd: Path) -> None:
    g, k, shape = _replace(f, fp)
    _, h5 = secret_files(sd, math.prod(shape))
    g[k] = h5py.ExternalLink(str(h5), "/data")


def _external_link_group(f: h5py.File, fp: Fingerprint, sd: Path) -> None:
    other = sd / "other.h5"
    sd.mkdir(parents=True, exist_ok=True)
    with h5py.File(other, "w", libver="latest") as o:
        g = o.create_group("tensors")
        for i, t in enumerate(fp.tensors):
            g.create_dataset(f"{i:06d}", data=np.zeros(t.shape, np.float32))
    del f["tensors"]
    f["tensors"] = h5py.ExternalLink(str(other), "/tensors")


def _soft_link(f: h5py.File, fp: Fingerprint, sd: Path) -> None:
    if "flat" in f:
        f["data"] = f["flat"][()]
        del f["flat"]
        f["flat"] = h5py.SoftLink("/data")
        return
    g, k, _shape = _replace(f, fp, 1)
    g[k] = h5py.SoftLink("/tensors/000000")


def _hard_alias(f: h5py.File, fp: Fingerprint, sd: Path) -> None:
    # A second name inside /tensors, the count of names still right: tensor 1 is tensor 0.
    del f["tensors"]["000001"]
    f["tensors"]["000001"] = f["tensors"]["000000"]


def _hard_alias_pure(f: h5py.File, fp: Fingerprint, sd: Path) -> None:
    f["copy"] = _data(f)  # one dataset under two names


def _virtual(f: h5py.File, fp: Fingerprint, sd: Path) -> None:
    """Tensor 0 (or /flat) as a virtual dataset whose rows map the server's secret file."""
    _, h5 = secret_files(sd, fp.n_params)
    g, k, shape = _replace(f, fp)
    rows, cols = (shape[0], math.prod(shape[1:])) if len(shape) > 1 else (1, math.prod(shape))
    layout = h5py.VirtualLayout(shape=(rows, cols) if len(shape) > 1 else shape, dtype="<f4")
    src = h5py.VirtualSource(str(h5), "data", shape=(fp.n_params,))
    if len(shape) > 1:
        for r in range(rows):
            layout[r] = src[r * cols : (r + 1) * cols]
    else:
        layout[:] = src[:cols]
    g.create_virtual_dataset(k, layout)


def _filter(compression: str) -> Callable[[h5py.File, Fingerprint, Path], None]:
    def fn(f: h5py.File, fp: Fingerprint, sd: Path) -> None:
        g, k, shape = _replace(f, fp)
        kw = {"shuffle": True} if compression == "shuffle" else {"compression": compression}
        g.create_dataset(k, data=np.zeros(shape, np.float32), chunks=True, **kw)
    return fn


def _huge_tensor(f: h5py.File, fp: Fingerprint, sd: Path) -> None:
    g, k, _shape = _replace(f, fp)
    g.create_dataset(k, shape=(HUGE,), dtype="<f4", chunks=(1 << 16,))  # nothing stored: fill value


def _unallocated(f: h5py.File, fp: Fingerprint, sd: Path) -> None:
    g, k, shape = _replace(f, fp)
    g.create_dataset(k, shape=shape, dtype="<f4")  # right shape, no data stored


def _last_external(f: h5py.File, fp: Fingerprint, sd: Path) -> None:
    raw, _ = secret_files(sd, fp.n_params)
    g, k, shape = _replace(f, fp, -1)
    g.create_dataset(k, shape=shape, dtype="<f4", external=[(str(raw), 0, 4 * math.prod(shape))])


def _last_unallocated(f: h5py.File, fp: Fingerprint, sd: Path) -> None:
    g, k, shape = _replace(f, fp, -1)
    g.create_dataset(k, shape=shape, dtype="<f4", chunks=True)  # 8 GB of fill value at most


def _huge_optimizer(f: h5py.File, fp: Fingerprint, sd: Path) -> None:
    og = f.create_group("optimizer")
    og.attrs["kind"] = "adam"
    og.create_dataset("000000", shape=(HUGE,), dtype="<f4", chunks=(1 << 20,))


def _huge_fingerprint(f: h5py.File, fp: Fingerprint, sd: Path) -> None:
    # The file claims a model of 2e9 values (its own fingerprint) and one matching dataset.
    f.attrs["fingerprint"] = json.dumps([["big", [HUGE], "float32"]])
    if "flat" in f:
        del f["flat"]
        f.create_dataset("flat", shape=(HUGE,), dtype="<f4", chunks=(1 << 20,))
        return
    del f["tensors"]
    g = f.create_group("tensors")
    g.create_dataset("000000", shape=(HUGE,), dtype="<f4", chunks=(1 << 20,))


def _dtype(dt: str) -> Callable[[h5py.File, Fingerprint, Path], None]:
    def fn(f: h5py.File, fp: Fingerprint, sd: Path) -> None:
        g, k, shape = _replace(f, fp)
        if dt == "vlen-str":
            g.create_dataset(k, shape=shape, dtype=h5py.string_dtype())
        elif dt == "compound":
            g.create_dataset(k, shape=shape, dtype=[("a", "<f4"), ("b", "<f4")])
        else:
            g.create_dataset(k, data=np.zeros(shape, dt))
    return fn


def _extra(kind: str) -> Callable[[h5py.File, Fingerprint, Path], None]:
    def fn(f: h5py.File, fp: Fingerprint, sd: Path) -> None:
        if kind == "root-dataset":
            f.create_dataset("payload", data=np.zeros(10))
        elif kind == "group-in-tensors":
            f["tensors"].create_group("zzz")
        elif kind == "tensor-in-tensors":
            f["tensors"].create_dataset(f"{len(fp.tensors):06d}", data=np.zeros(3, np.float32))
        elif kind == "named-type":
            f["sometype"] = np.dtype("<f4")
        elif kind == "root-attr":
            f.attrs["secret"] = "x"
        elif kind == "tensor-attr":
            (f["flat"] if "flat" in f else f["tensors"]["000000"]).attrs["more"] = 1
        elif kind == "tensors-in-v2":
            f.create_group("tensors").create_dataset("000000", data=np.zeros(3, np.float32))
        elif kind == "flat-in-v1":
            f.create_dataset("flat", data=np.zeros(fp.n_params, np.float32))
        elif kind == "v2-holding-tensors":
            f.attrs["format_version"] = 2
        elif kind.startswith("version="):
            v = kind[len("version="):]
            if v == "absent":
                del f.attrs["format_version"]
            elif v == "string":
                f.attrs["format_version"] = "2"
            elif v == "array":
                f.attrs["format_version"] = np.array([2, 2])
            else:
                f.attrs["format_version"] = int(v)
        elif kind == "big-attr":
            f.attrs["metrics"] = json.dumps({"pad": "x" * (2 << 20)})
        elif kind == "array-attr":
            f.attrs["unit"] = ["a", "b"]
        elif kind == "deep-metrics":
            f.attrs["metrics"] = "[" * 50_000 + "]" * 50_000
        elif kind == "deep-fingerprint":
            f.attrs["fingerprint"] = "[" * 50_000 + "]" * 50_000
        elif kind == "negative-dim":
            f.attrs["fingerprint"] = json.dumps([["x", [-5], "float32"]])
        elif kind == "null-space":
            g, k, _shape = _replace(f, fp)
            g.create_dataset(k, data=h5py.Empty("<f4"))
    return fn


def _raw(fn: Callable[[bytes], bytes]) -> Callable[[Path, Fingerprint, str, str, Path], None]:
    def build(path: Path, fp: Fingerprint, job: str, unit: str, sd: Path) -> None:
        valid(path, fp, job, unit, version=1)
        path.write_bytes(fn(path.read_bytes()))
    return build


def _userblock(path: Path, fp: Fingerprint, job: str, unit: str, sd: Path) -> None:
    flat = np.zeros(fp.n_params, np.float32)
    with h5py.File(path, "w", libver="latest", userblock_size=512) as f:
        for k, v in (("format", "boinc-dl-weights"), ("format_version", 1), ("fingerprint", fp.to_json()),
                     ("job", job), ("model", "0"), ("unit", unit), ("metrics", "{}")):
            f.attrs[k] = v
        g = f.create_group("tensors")
        for i, a in enumerate(fp.split(flat)):
            g.create_dataset(f"{i:06d}", data=a)
    with path.open("r+b") as fh:
        fh.write(b"#!/bin/sh\n# anything can hide in a user block\n")


def _earliest(path: Path, fp: Fingerprint, job: str, unit: str, sd: Path) -> None:
    valid(path, fp, job, unit, version=1)
    _earliest_copy(path)


def _earliest_copy(path: Path) -> None:
    """Rewrite ``path`` with HDF5's earliest superblock (version 0: a driver-info block)."""
    with h5py.File(path, "r") as src, h5py.File(path.with_suffix(".v0"), "w", libver="earliest") as dst:
        for k, v in src.attrs.items():
            dst.attrs[k] = v
        src.copy("flat" if "flat" in src else "tensors", dst)
    path.with_suffix(".v0").replace(path)


def _family(path: Path, fp: Fingerprint, job: str, unit: str, sd: Path) -> None:
    # A family-driver file: member 0 holds the superblock with its driver-info block.
    tmpl = path.parent / f"{path.name}.fam%d"
    with h5py.File(tmpl, "w", driver="family", memb_size=1 << 20) as f:
        f.attrs["format"] = "boinc-dl-weights"
        f.attrs["fingerprint"] = fp.to_json()
        f.attrs["job"], f.attrs["unit"] = job, unit
        g = f.create_group("tensors")
        for i, t in enumerate(fp.tensors):
            g.create_dataset(f"{i:06d}", data=np.zeros(t.shape, np.float32))
    (path.parent / f"{path.name}.fam0").replace(path)


def _swmr(path: Path, fp: Fingerprint, job: str, unit: str, sd: Path) -> None:
    valid(path, fp, job, unit)
    with h5py.File(path, "a", libver="latest") as f:
        f.swmr_mode = True
        snapshot = path.read_bytes()  # copied while open for SWMR writing: flags set
    path.write_bytes(snapshot)


ATTACKS: list[Attack] = [
    Attack("external-storage", _edit(_external_storage), "external files"),
    Attack("external-link", _edit(_external_link), "external"),
    Attack("external-link-group", _edit(_external_link_group), "external"),
    Attack("soft-link", _edit(_soft_link), "soft"),
    # A second name outside the expected objects is refused by its name before the alias is seen.
    Attack("hard-link-alias", _edit(_hard_alias_pure), "unexpected top-level"),
    Attack("hard-link-alias-in-tensors", _edit(_hard_alias), "more than one name"),
    Attack("virtual-dataset", _edit(_virtual), "virtual"),
    Attack("filter-gzip", _edit(_filter("gzip")), "filtered"),
    Attack("filter-lzf", _edit(_filter("lzf")), "filtered"),
    Attack("filter-shuffle", _edit(_filter("shuffle")), "filtered"),
    Attack("huge-tensor", _edit(_huge_tensor), "shape"),
    Attack("huge-optimizer", _edit(_huge_optimizer), "declares"),
    Attack("huge-fingerprint", _edit(_huge_fingerprint), "tensor"),
    Attack("unallocated", _edit(_unallocated), "fill values"),
    Attack("last-tensor-external-storage", _edit(_last_external), "external files"),
    Attack("last-tensor-unallocated", _edit(_last_unallocated), "fill values"),
    Attack("dtype-float64", _edit(_dtype("<f8")), "float32"),
    Attack("dtype-big-endian", _edit(_dtype(">f4")), "float32"),
    Attack("dtype-int", _edit(_dtype("<i4")), "float32"),
    Attack("dtype-vlen-string", _edit(_dtype("vlen-str")), "float32"),
    Attack("dtype-compound", _edit(_dtype("compound")), "float32"),
    Attack("extra-root-dataset", _edit(_extra("root-dataset")), "unexpected top-level"),
    Attack("extra-group-in-tensors", _edit(_extra("group-in-tensors")), "tensors"),
    Attack("extra-tensor", _edit(_extra("tensor-in-tensors")), "tensors"),
    Attack("named-datatype", _edit(_extra("named-type")), "unexpected top-level"),
    Attack("extra-root-attribute", _edit(_extra("root-attr")), "unexpected attribute"),
    Attack("extra-tensor-attribute", _edit(_extra("tensor-attr")), "unexpected attributes"),
    Attack("big-attribute", _edit(_extra("big-attr")), "over"),
    Attack("array-attribute", _edit(_extra("array-attr")), "not a scalar"),
    Attack("deep-metrics-attribute", _edit(_extra("deep-metrics")), "nested"),
    Attack("deep-fingerprint", _edit(_extra("deep-fingerprint")), "fingerprint"),
    Attack("negative-dimension", _edit(_extra("negative-dim")), "fingerprint"),
    Attack("null-dataspace", _edit(_extra("null-space")), "null dataspace"),
    Attack("truncated", _raw(lambda b: b[: len(b) * 2 // 3]), "weights"),
    Attack("truncated-header", _raw(lambda b: b[:40]), "weights"),
    Attack("userblock", _userblock, "offset 0"),
    Attack("superblock-v0", _earliest, "superblock version"),
    Attack("family-driver", _family, "superblock version"),
    Attack("swmr-flagged", _swmr, "open for writing"),
]

# The same attacks on a version-2 file (one /flat dataset) where they apply, and the
# attacks on the version itself.
ATTACKS += [
    Attack("external-storage-v2", _edit(_external_storage, 2), "external files"),
    Attack("external-link-v2", _edit(_external_link, 2), "external"),
    Attack("soft-link-v2", _edit(_soft_link, 2), "soft"),
    Attack("hard-link-alias-v2", _edit(_hard_alias_pure, 2), "unexpected top-level"),
    Attack("virtual-dataset-v2", _edit(_virtual, 2), "virtual"),
    Attack("filter-gzip-v2", _edit(_filter("gzip"), 2), "filtered"),
    Attack("filter-shuffle-v2", _edit(_filter("shuffle"), 2), "filtered"),
    Attack("huge-tensor-v2", _edit(_huge_tensor, 2), "shape"),
    Attack("huge-optimizer-v2", _edit(_huge_optimizer, 2), "declares"),
    Attack("huge-fingerprint-v2", _edit(_huge_fingerprint, 2), "tensor"),
    Attack("unallocated-v2", _edit(_unallocated, 2), "fill values"),
    Attack("dtype-float64-v2", _edit(_dtype("<f8"), 2), "float32"),
    Attack("dtype-big-endian-v2", _edit(_dtype(">f4"), 2), "float32"),
    Attack("dtype-vlen-string-v2", _edit(_dtype("vlen-str"), 2), "float32"),
    Attack("extra-root-dataset-v2", _edit(_extra("root-dataset"), 2), "unexpected top-level"),
    Attack("extra-flat-attribute-v2", _edit(_extra("tensor-attr"), 2), "unexpected attributes"),
    Attack("null-dataspace-v2", _edit(_extra("null-space"), 2), "null dataspace"),
    Attack("superblock-v0-v2", lambda p, fp, j, u, sd: _earliest_v2(p, fp, j, u, sd), "superblock version"),
    Attack("truncated-v2", lambda p, fp, j, u, sd: _truncated_v2(p, fp, j, u), "weights"),
    Attack("v2-file-holding-tensors", _edit(_extra("tensors-in-v2"), 2), "unexpected top-level"),
    Attack("v1-file-holding-flat", _edit(_extra("flat-in-v1"), 1), "unexpected top-level"),
    Attack("v1-layout-declared-v2", _edit(_extra("v2-holding-tensors"), 1), "unexpected top-level"),
    Attack("format-version-3", _edit(_extra("version=3"), 2), "format_version"),
    Attack("format-version-0", _edit(_extra("version=0"), 2), "format_version"),
    Attack("format-version-huge", _edit(_extra("version=1099511627776"), 2), "format_version"),
    Attack("format-version-absent", _edit(_extra("version=absent"), 2), "format_version"),
    Attack("format-version-string", _edit(_extra("version=string"), 2), "format_version"),
    Attack("format-version-array", _edit(_extra("version=array"), 2), "not a scalar"),
]


# ---- what HDF5 itself reads: variable-length attributes, depth, width -----------------------

def vlen_attribute(n_bytes: int, attr: str = "format") -> Callable[[Path, Fingerprint, str, str, Path], None]:
    """A valid file whose variable-length string attribute ``attr`` holds ``n_bytes``
    (its storage size still reads 16 bytes: the descriptor)."""
    def build(path: Path, fp: Fingerprint, job: str, unit: str, sd: Path) -> None:
        valid(path, fp, job, unit)
        with h5py.File(path, "a") as f:
            f.attrs[attr] = "x" * n_bytes
    return build


def vlen_length_lie(length: int, dense: bool) -> Callable[[Path, Fingerprint, str, str, Path], None]:
    """A small file whose ``format`` attribute *declares* ``length`` bytes (its heap object
    holds 16): HDF5 zero-fills the declared length before it reads the heap. ``dense``:
    the attributes in a fractal heap, as write_weights' ten make; else in the object
    header (a file with few attributes)."""
    def build(path: Path, fp: Fingerprint, job: str, unit: str, sd: Path) -> None:
        from tests.support.h5craft import set_vlen_length

        if dense:
            valid(path, fp, job, unit)
        else:
            with h5py.File(path, "w", libver="latest") as f:
                f.attrs["format"] = "boinc-dl-weights"
                f.create_dataset("flat", data=np.zeros(fp.n_params, "<f4"))
        set_vlen_length(path, "format", length)
    return build


def deep_groups(depth: int, where: str = "optimizer") -> Callable[[Path, Fingerprint, str, str, Path], None]:
    """A valid file plus a chain of ``depth`` nested groups under ``/where`` (a few bytes
    per level: 20 000 levels in about 3 MB)."""
    def build(path: Path, fp: Fingerprint, job: str, unit: str, sd: Path) -> None:
        valid(path, fp, job, unit, version=1 if where == "tensors" else 2)
        with h5py.File(path, "a", libver="latest") as f:
            g = f.require_group(where)
            gid = g.id
            for _ in range(depth):
                gid = h5py.h5g.create(gid, b"a")
    return build


def wide_group(n: int, where: str = "optimizer") -> Callable[[Path, Fingerprint, str, str, Path], None]:
    """A valid file plus ``n`` sibling groups under ``/where``."""
    def build(path: Path, fp: Fingerprint, job: str, unit: str, sd: Path) -> None:
        valid(path, fp, job, unit)
        with h5py.File(path, "a", libver="latest") as f:
            gid = f.require_group(where).id
            for i in range(n):
                h5py.h5g.create(gid, f"g{i}".encode())
    return build


def huge_heap_collection(extra: int) -> Callable[[Path, Fingerprint, str, str, Path], None]:
    """A valid file whose attribute strings are small, in a global heap collection that
    declares ``extra`` more bytes (present, zeros): HDF5 reads a collection whole."""
    def build(path: Path, fp: Fingerprint, job: str, unit: str, sd: Path) -> None:
        from tests.support.h5craft import grow_global_heap

        valid(path, fp, job, unit)
        grow_global_heap(path, extra)
    return build


ATTACKS += [
    Attack("heap-collection-8mb", huge_heap_collection(8 << 20), "global heap collection"),
    Attack("vlen-format-6mb", vlen_attribute(6 << 20), "over 4194304 bytes"),
    Attack("vlen-metrics-2mb", vlen_attribute(2 << 20, "metrics"), "over 1048576 bytes"),
    Attack("vlen-length-lie-4gb", vlen_length_lie(0xF0000000, dense=False), "over"),
    Attack("vlen-length-lie-4gb-dense", vlen_length_lie(0xF0000000, dense=True), "over"),
    Attack("deep-groups-20000", deep_groups(20_000), "group where a dataset belongs"),
    Attack("deep-groups-in-tensors", deep_groups(2_000, "tensors"), "tensors"),
    Attack("wide-group-20000", wide_group(20_000), "at most"),
]


def _earliest_v2(path: Path, fp: Fingerprint, job: str, unit: str, sd: Path) -> None:
    valid(path, fp, job, unit, version=2)
    _earliest_copy(path)


def _truncated_v2(path: Path, fp: Fingerprint, job: str, unit: str) -> None:
    valid(path, fp, job, unit, version=2)
    path.write_bytes(path.read_bytes()[:-64])


# ---- metrics and uploads ------------------------------------------------------------------

METRICS_ATTACKS: dict[str, tuple[bytes, str]] = {
    "deep-list": (b"[" * 100_000 + b"]" * 100_000, "nested"),
    "deep-object": (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "nested"),
    "moderately-deep": (b'{"a":' + b"[" * 40 + b"]" * 40 + b"}", "nested"),
    "oversized": (b'{"pad": "' + b"x" * (2 << 20) + b'"}', "bound"),
    "not-utf8": (b'{"a": "\xff\xfe"}', "not JSON"),
    "huge-integer": (b'{"a": ' + b"9" * 100_000 + b"}", "not JSON"),
    "not-an-object": (b"[1, 2, 3]", "not a JSON object"),
    # A second value for a key: which one counts would be the parser's choice, not ours.
    "duplicate-key": (b'{"val_acc": 0.5, "val_acc": 99.0}', "duplicate"),
}


def gzip_bomb(path: Path, n_bytes: int) -> Path:
    """A gzip file that expands to ``n_bytes`` of zeros (about 1000x smaller on disk)."""
    chunk = bytes(1 << 20)
    with gzip.open(path, "wb", compresslevel=9) as f:
        for _ in range(n_bytes // len(chunk)):
            f.write(chunk)
    return path


# Unit ids that try to leave the results directory, or are otherwise unusable in a path.
TRAVERSAL_UNITS = ["../../../escaped", "..", "a/../../escaped", "/tmp/abs", "x\0y", "", " spaced", "-rf",
                   "..hidden", "a" * 300, "ünïcode", "back\\slash"]
