"""Optimizer state carried in weights files (MOP): round trip and validation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.errors import ResultRejected
from boinc_dl.server.common.weights import OptimizerState, WeightsFile, read_weights, write_weights
from tests.support.results import assimilate_error, assimilate_files, validate

from .conftest import tiny_fingerprint, tiny_spec


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


def test_mop_state_is_in_place_before_the_merge_lands(redis_client, tmp_path: Path) -> None:
    """The generator issues a model's next unit the moment its merge lands: the optimizer
    state that unit must start from is already there, tagged with the merged version."""
    spec = tiny_spec("tinymop", mode="mop", mop={"partitions": 2, "param_grid": {"hidden": [8]}})
    fp = tiny_fingerprint()
    at_merge: list[tuple[int, int] | None] = []

    def during_merge(_n: int) -> None:
        blob = store.optimizer_state("0")
        at_merge.append(None if blob is None else (OptimizerState.from_bytes(blob)[1], store.version("0")))

    store = JobStore(redis_client, spec.name, on_shard_applied=during_merge)
    store.create(spec.model_dump_json(), "mop", {"0": fp}, {})
    store.init_weights("0", np.zeros(fp.n_params, np.float32))
    base = tmp_path / "base.h5"
    write_weights(base, WeightsFile(np.zeros(fp.n_params, np.float32), fp, job=spec.name, model="0"))
    for i in range(2):
        unit = f"m{i}"
        store.register_unit(unit, {"epoch": 1, "shard": i, "model": "0", "weights_version": i,
                                   "files": {"weights_in.h5": str(base)}}, 1)
        write_weights(tmp_path / f"{unit}.h5", WeightsFile(np.full(fp.n_params, i + 1, np.float32), fp,
                                                           job=spec.name, unit=unit, model="0",
                                                           optimizer=_opt(fp.n_params)))
        (tmp_path / f"{unit}.json").write_text(json.dumps({"unit": unit}))
        out = assimilate_files(store, [tmp_path / f"{unit}.h5", tmp_path / f"{unit}.json"], spec, unit=unit)
        assert out.status == "merged", out
        state, version = OptimizerState.from_bytes(store.optimizer_state("0") or b"")
        assert version == store.version("0") == i + 1 and state.kind == "adam"
    # Seen from inside each merge, before it committed (version still the old one): the
    # state already there, tagged with the version the merge makes.
    assert at_merge == [(1, 0), (2, 1)]


def test_a_late_result_cannot_plant_the_next_units_optimizer_state(redis_client, tmp_path: Path) -> None:
    """A host's late result of a MOP unit already given up carries a crafted optimizer
    state (within every bound). Its merge is refused; it must also leave no state the
    model's next merge would hand on. The next result carries no state (an optimizer
    without one): after its merge the model has no state, not the attacker's."""
    spec = tiny_spec("tinymop2", mode="mop", mop={"partitions": 2, "param_grid": {"hidden": [8]}})
    fp = tiny_fingerprint()
    store = JobStore(redis_client, spec.name)
    store.create(spec.model_dump_json(), "mop", {"0": fp}, {})
    store.init_weights("0", np.zeros(fp.n_params, np.float32))
    base = tmp_path / "base.h5"
    write_weights(base, WeightsFile(np.zeros(fp.n_params, np.float32), fp, job=spec.name, model="0"))
    for unit, shard in (("late", 0), ("next", 1)):
        store.register_unit(unit, {"epoch": 1, "shard": shard, "model": "0", "weights_version": 0,
                                   "files": {"weights_in.h5": str(base)}}, 1)
    assert assimilate_error(store, "late", "deadline passed").status != "merged"

    crafted = OptimizerState("adam", [np.array(1, np.int64), np.full(fp.n_params, 50, np.float32),
                                      np.full(fp.n_params, 1e-12, np.float32)])
    write_weights(tmp_path / "late.h5", WeightsFile(np.ones(fp.n_params, np.float32), fp, job=spec.name,
                                                    unit="late", model="0", optimizer=crafted))
    (tmp_path / "late.json").write_text(json.dumps({"unit": "late"}))
    out = assimilate_files(store, [tmp_path / "late.h5", tmp_path / "late.json"], spec, unit="late")
    assert out.status != "merged" and store.version("0") == 0
    assert store.optimizer_state("0") is None

    write_weights(tmp_path / "next.h5", WeightsFile(np.ones(fp.n_params, np.float32), fp, job=spec.name,
                                                    unit="next", model="0"))
    (tmp_path / "next.json").write_text(json.dumps({"unit": "next"}))
    assert assimilate_files(store, [tmp_path / "next.h5", tmp_path / "next.json"], spec, unit="next").status == "merged"
    assert store.version("0") == 1 and store.optimizer_state("0") is None


def test_a_result_without_a_state_clears_the_one_stored(redis_client, tmp_path: Path) -> None:
    """A state planted earlier (any version) never survives a merge whose result has none."""
    spec = tiny_spec("tinymop3", mode="mop", mop={"partitions": 2, "param_grid": {"hidden": [8]}})
    fp = tiny_fingerprint()
    store = JobStore(redis_client, spec.name)
    store.create(spec.model_dump_json(), "mop", {"0": fp}, {})
    store.init_weights("0", np.zeros(fp.n_params, np.float32))
    store.set_optimizer_state("0", _opt(fp.n_params).to_bytes(1))
    base = tmp_path / "base.h5"
    write_weights(base, WeightsFile(np.zeros(fp.n_params, np.float32), fp, job=spec.name, model="0"))
    store.register_unit("u", {"epoch": 1, "shard": 0, "model": "0", "weights_version": 0,
                              "files": {"weights_in.h5": str(base)}}, 1)
    write_weights(tmp_path / "u.h5", WeightsFile(np.ones(fp.n_params, np.float32), fp, job=spec.name,
                                                 unit="u", model="0"))
    (tmp_path / "u.json").write_text(json.dumps({"unit": "u"}))
    assert assimilate_files(store, [tmp_path / "u.h5", tmp_path / "u.json"], spec, unit="u").status == "merged"
    assert store.version("0") == 1 and store.optimizer_state("0") is None
