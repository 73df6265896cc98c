"""Result validation: every bad result is rejected with a clear reason; good ones merge."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from boinc_dl.server.common.errors import ResultRejected
from boinc_dl.server.common.weights import WeightsFile, fingerprint_of, write_weights
from tests.support.results import assimilate_error, assimilate_files, validate


def _result(tmp: Path, fp, flat=None, unit="u0", job="tiny", metrics: str | None = None, name="r") -> list[str]:
    d = tmp / name
    d.mkdir()
    flat = np.ones(fp.n_params, np.float32) if flat is None else flat
    write_weights(d / "weights_out.h5", WeightsFile(flat, fp, job=job, model="0", unit=unit))
    (d / "metrics.json").write_text(metrics if metrics is not None else json.dumps({"val_acc": 0.9, "unit": unit}))
    return [str(d / "weights_out.h5"), str(d / "metrics.json")]


def test_good_result_merges_once(tiny_job, tmp_path: Path) -> None:
    store, spec, fp = tiny_job
    paths = _result(tmp_path, fp)
    out = assimilate_files(store, paths, spec, "u0_0")
    assert out.status == "merged" and out.version == 1
    assert np.allclose(store.get_weights("0")[0], 0.5)
    assert assimilate_files(store, paths, spec, "u0_1").status == "duplicate"
    assert store.version("0") == 1


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"flat": np.full(15, np.nan, np.float32)}, "NaN/Inf"),
        ({"unit": "nope"}, "embeds unit"),
        ({"job": "other"}, "embeds job"),
        ({"metrics": "{not json"}, "not JSON"),
        ({"metrics": "[1, 2]"}, "not a JSON object"),
    ],
)
def test_rejections(tiny_job, tmp_path: Path, kwargs, reason: str) -> None:
    store, spec, fp = tiny_job
    paths = _result(tmp_path, fp, **kwargs)
    with pytest.raises(ResultRejected, match=reason):
        validate(paths, store, spec.units.max_upload_bytes, "u0")
    out = assimilate_files(store, paths, spec, "r_0", unit="u0")
    assert out.status == "rejected" and reason.split()[0] in out.reason
    assert store.version("0") == 0
    assert store.rejections(1)[0]["reason"] == out.reason


def test_wrong_shapes_and_sizes(tiny_job, tmp_path: Path) -> None:
    store, spec, _fp = tiny_job
    other = fingerprint_of(["dense/kernel", "dense/bias"], [np.zeros((5, 3)), np.zeros(3)])
    with pytest.raises(ResultRejected, match="shape"):
        validate(_result(tmp_path, other, np.ones(18, np.float32)), store, 10**9, "u0")
    with pytest.raises(ResultRejected, match="over the"):
        validate(_result(tmp_path, _fp, name="big"), store, 100, "u0")


def test_truncated_and_missing(tiny_job, tmp_path: Path) -> None:
    store, _spec, fp = tiny_job
    paths = _result(tmp_path, fp)
    data = Path(paths[0]).read_bytes()
    Path(paths[0]).write_bytes(data[: len(data) // 2])
    with pytest.raises(ResultRejected):
        validate(paths, store, 10**9, "u0")
    with pytest.raises(ResultRejected, match="missing"):
        validate([str(tmp_path / "nothing.h5")], store, 10**9, "u0")


def test_update_norm_bound(tiny_job, tmp_path: Path) -> None:
    store, spec, fp = tiny_job
    spec = spec.model_copy(update={"validation": spec.validation.model_copy(update={"max_update_norm": 10.0})})
    far = _result(tmp_path, fp, np.full(fp.n_params, 100.0, np.float32), name="far")
    out = assimilate_files(store, far, spec, "u0_0")
    assert out.status == "rejected" and "exceeds max_update_norm" in out.reason
    near = _result(tmp_path, fp, np.full(fp.n_params, 1.0, np.float32), unit="u1", name="near")
    assert assimilate_files(store, near, spec, "u1_0").status == "merged"


def test_error_call_marks_failed_once(tiny_job) -> None:
    store, _spec, _fp = tiny_job
    assert assimilate_error(store, "u4", "too many errors").status == "failed"
    assimilate_error(store, "u4", "too many errors")
    assert store.epoch_counts(1)["failed"] == 1
    assert assimilate_error(store, "zzz", "x").status == "rejected"
