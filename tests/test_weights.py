"""The HDF5 weights file: round trip, fingerprint checks, damaged files."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from boinc_dl.server.common.errors import WeightsFormatError
from boinc_dl.server.common.weights import (
    WeightsFile,
    fingerprint_of,
    read_header,
    read_weights,
    write_weights,
)

from .conftest import tiny_fingerprint

VERSIONS = pytest.mark.parametrize("version", [2, 1], ids=["v2-flat", "v1-per-tensor"])


def _write(path: Path, flat: np.ndarray | None = None, version: int = 2, **kw) -> WeightsFile:
    fp = kw.pop("fp", tiny_fingerprint())
    flat = np.arange(fp.n_params, dtype=np.float32) if flat is None else flat
    wf = WeightsFile(flat, fp, job="j", model="0", unit="u1", base_version=3, examples_seen=99,
                     metrics={"val_acc": 0.5}, **kw)
    write_weights(path, wf, format_version=version)
    return wf


@VERSIONS
def test_round_trip(tmp_path: Path, version: int) -> None:
    wf = _write(tmp_path / "w.h5", version=version)
    got = read_weights(tmp_path / "w.h5", expected=wf.fingerprint)
    assert np.array_equal(got.flat, wf.flat)
    assert (got.job, got.unit, got.base_version, got.examples_seen) == ("j", "u1", 3, 99)
    assert got.metrics == {"val_acc": 0.5} and got.format_version == version
    assert read_header(tmp_path / "w.h5").format_version == version
    with h5py.File(tmp_path / "w.h5") as f:
        assert f.attrs["format_version"] == version
        if version == 2:  # every tensor in one flat dataset, no attributes
            assert list(f) == ["flat"] and f["flat"].shape == (15,) and not f["flat"].attrs
        else:  # one dataset per tensor, named attrs
            assert [f["tensors"][k].attrs["name"] for k in sorted(f["tensors"])] == ["dense/kernel", "dense/bias"]
            assert f["tensors"]["000000"].shape == (4, 3)


def test_writer_refuses_unknown_versions(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="format_version 3"):
        _write(tmp_path / "w.h5", version=3)


def _copy(src_path: Path, dst_path: Path, **ds_kw) -> None:
    """Rewrite a weights file dataset by dataset with h5py options (another writer)."""
    with h5py.File(src_path, "r") as src, h5py.File(dst_path, "w", libver="latest") as dst:
        for k, v in src.attrs.items():
            dst.attrs[k] = v
        if "flat" in src:
            dst.create_dataset("flat", data=src["flat"][()], **ds_kw)
            return
        g = dst.create_group("tensors")
        for k in src["tensors"]:
            g.create_dataset(k, data=src["tensors"][k][()], **ds_kw)


@VERSIONS
def test_chunked_read_compressed_rejected(tmp_path: Path, version: int) -> None:
    wf = _write(tmp_path / "w.h5", version=version)
    _copy(tmp_path / "w.h5", tmp_path / "c.h5", chunks=True)
    assert np.array_equal(read_weights(tmp_path / "c.h5", wf.fingerprint).flat, wf.flat)
    _copy(tmp_path / "w.h5", tmp_path / "z.h5", chunks=True, compression="gzip")
    with pytest.raises(WeightsFormatError, match="filtered"):
        read_weights(tmp_path / "z.h5", wf.fingerprint)


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (fingerprint_of(["dense/kernel", "dense/bias"], [np.zeros((3, 4)), np.zeros(3)]), "shape"),
        (fingerprint_of(["x/kernel", "dense/bias"], [np.zeros((4, 3)), np.zeros(3)]), "name"),
        (fingerprint_of(["dense/kernel"], [np.zeros((4, 3))]), "tensors"),
    ],
)
@VERSIONS
def test_fingerprint_mismatch(tmp_path: Path, other, message: str, version: int) -> None:
    _write(tmp_path / "w.h5", fp=other, flat=np.zeros(other.n_params, np.float32), version=version)
    with pytest.raises(WeightsFormatError, match=message):
        read_weights(tmp_path / "w.h5", expected=tiny_fingerprint())


def test_truncated_and_garbage_files(tmp_path: Path) -> None:
    _write(tmp_path / "w.h5")
    data = (tmp_path / "w.h5").read_bytes()
    for i, cut in enumerate((10, len(data) // 2, len(data) - 7)):
        p = tmp_path / f"t{i}.h5"
        p.write_bytes(data[:cut])
        with pytest.raises(WeightsFormatError):
            read_weights(p, tiny_fingerprint())
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"not an hdf5 file at all")
    with pytest.raises(WeightsFormatError, match="junk.h5"):
        read_weights(junk)
    with pytest.raises(WeightsFormatError):
        read_header(junk)
    with pytest.raises(WeightsFormatError, match="cannot read"):
        read_weights(tmp_path / "missing.h5")


@VERSIONS
def test_wrong_dtype_rejected(tmp_path: Path, version: int) -> None:
    wf = _write(tmp_path / "w.h5", version=version)
    with h5py.File(tmp_path / "w.h5", "a") as f:
        if version == 2:
            del f["flat"]
            f.create_dataset("flat", data=np.zeros(15, np.float64))
        else:
            del f["tensors/000001"]
            f["tensors"].create_dataset("000001", data=np.zeros(3, np.float64))
    with pytest.raises(WeightsFormatError, match="float32"):
        read_weights(tmp_path / "w.h5", wf.fingerprint)


def test_write_checks_buffer(tmp_path: Path) -> None:
    with pytest.raises(WeightsFormatError):
        write_weights(tmp_path / "w.h5", WeightsFile(np.zeros(3, np.float32), tiny_fingerprint()))
