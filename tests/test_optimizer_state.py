"""Optimizer state carried in weights files (MOP): round trip and validation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from boinc_dl.server.common.errors import ResultRejected
from boinc_dl.server.common.weights import OptimizerState, WeightsFile, read_weights, write_weights
from tests.support.results import validate

from .conftest import tiny_fingerprint


def _opt(n: int = 15) -> OptimizerState:
    return OptimizerState("adam", [np.array(7, np.int64), np.ones(n, np.float32), np.full(n, 2, np.float32)])


def test_round_trip_file_and_bytes(tmp_path: Path) -> None:
    fp = tiny_fingerprint()
    write_weights(tmp_path / "w.h5", WeightsFile(np.zeros(fp.n_params, np.float32), fp, optimizer=_opt()))
    got = read_weights(tmp_path / "w.h5", fp).optimizer
    assert got is not None and got.kind == "adam"
    assert [a.tolist() for a in got.arrays] == [a.tolist() for a in _opt().arrays]
    back, version = OptimizerState.from_bytes(got.to_bytes(12))
    assert version == 12 and back.arrays[0].dtype == np.int64 and np.array_equal(back.arrays[2], got.arrays[2])


@pytest.mark.parametrize(("arrays", "reason"), [
    ([np.full(3, np.nan, np.float32)], "NaN/Inf"),
    ([np.ones(1000, np.float32)], "optimizer state has"),
])
def test_bad_optimizer_state_rejected(tiny_job, tmp_path: Path, arrays, reason: str) -> None:
    store, spec, fp = tiny_job
    write_weights(tmp_path / "w.h5", WeightsFile(np.ones(fp.n_params, np.float32), fp, job="tiny", unit="u0",
                                                 optimizer=OptimizerState("adam", arrays)))
    (tmp_path / "m.json").write_text(json.dumps({"unit": "u0"}))
    with pytest.raises(ResultRejected, match=reason):
        validate([tmp_path / "w.h5", tmp_path / "m.json"], store, 10**9, "u0")
