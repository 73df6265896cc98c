"""MOP end to end on the local backend: invariants under preemption, failing
configurations, bad input, and bitwise reproducibility of a recorded schedule."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.errors import SpecError
from boinc_dl.server.common.spec import parse_spec
from boinc_dl.server.common.weights import OptimizerState
from boinc_dl.server.run import run_job
from tests.support.mop_replay import replay_model

from .conftest import REPO

pytestmark = pytest.mark.slow


def _spec(name: str, **over):
    data = {
        "name": name, "mode": "mop", "model": "models:mlp", "model_args": {"hidden": 16},
        "dataset": {"name": "digits", "limit": 400},
        "training": {"epochs": 2, "batch_size": 32, "learning_rate": 0.01},
        "mop": {"partitions": 2, "param_grid": {"hidden": [8, 16], "learning_rate": [0.01, 0.003]}},
        "units": {"timeout_s": 20, "checkpoint_every_s": 1},
        "backend": {"local": {"workers": 2, "slots": 1, "assimilators": 2}},
        "seed": 5,
    }
    for k, v in over.items():
        data[k] = {**data[k], **v} if isinstance(v, dict) and isinstance(data.get(k), dict) else v
    return parse_spec(data)


def _check_invariants(store: JobStore, n_models: int, partitions: int, epochs: int) -> None:
    merges = list(store.metrics("merge"))
    per_model_epoch: dict[tuple[str, int], list[int]] = defaultdict(list)
    for m in merges:
        info = store.unit_info(m["unit"])
        per_model_epoch[(info["model"], info["epoch"])].append(info["shard"])
        # Model isolation: each unit trained from the version it replaced (no overlap).
        assert m["base_version"] == m["base_version_seen"], m
    assert len(per_model_epoch) == n_models * epochs
    for parts in per_model_epoch.values():  # completeness: each partition once per epoch
        assert sorted(parts) == list(range(partitions))


def test_mop_grid_with_preemption_keeps_invariants(tmp_path: Path, redis_server) -> None:
    spec = _spec("mop-chaos", units={"timeout_s": 4, "max_error_results": 8, "max_total_results": 10},
                 training={"local_epochs": 4, "batch_size": 8})
    res = run_job(spec, tmp_path / "run", live=False, redis_url=redis_server.url,
                  search_path=REPO / "examples", backend_opts={"preempt_prob": 0.3})
    assert res.status == "done", res.reason
    assert res.backend["preempted"] >= 1 and res.backend["reissued"] >= 1
    store = JobStore(connect(redis_server.url), spec.name)
    _check_invariants(store, 4, 2, 2)
    run = tmp_path / "run"
    for f in ("leaderboard.csv", "learning_curves.png", "best_model.keras", "history.json"):
        assert (run / f).stat().st_size > 0
    # Each host holds only its own partition: half the training data per host.
    per_host = res.backend["data_bytes_per_host"]
    sizes = [(run / "files" / f"{spec.name}__shard{k:04d}.npz").stat().st_size for k in range(2)]
    assert sorted(per_host.values()) == sorted(sizes)


def test_reproducible_and_failing_configuration(tmp_path: Path, redis_server) -> None:
    """A configuration whose model cannot be built fails alone; a recorded schedule
    replayed sequentially reproduces a model's weights bitwise."""
    spec = _spec("mop-repro", mop={"partitions": 2, "param_grid": {"hidden": [8, -3]}})
    res = run_job(spec, tmp_path / "run", live=False, redis_url=redis_server.url, search_path=REPO / "examples")
    assert res.status == "done"
    store = JobStore(connect(redis_server.url), spec.name)
    configs = {k.decode(): json.loads(v) for k, v in store.r.hgetall(store.k("configs")).items()}
    status = Counter(c["status"] for c in configs.values())
    assert status == {"failed": 1, "finished": 1}
    failed = next(c for c in configs.values() if c["status"] == "failed")
    assert "hidden" in json.dumps(failed["params"]) and failed["reason"]
    good = next(k for k, c in configs.items() if c["status"] == "finished")
    # The optimizer state hopped with the model and belongs to its latest weights.
    state, version = OptimizerState.from_bytes(store.r.get(store.k("opt", good)))
    assert version == store.version(good) and state.kind == "adam" and state.arrays
    flat, units = replay_model(store, tmp_path / "run", good)
    assert len(units) == 4
    np.testing.assert_array_equal(flat, store.get_weights(good)[0])


def test_bad_mop_input(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="param_grid"):
        _spec("e", mop={"partitions": 2, "param_grid": {}})
    with pytest.raises(SpecError, match="param_grid"):
        _spec("e", mop={"partitions": 2, "param_grid": {"hidden": []}})
    with pytest.raises(SpecError, match="mop"):
        parse_spec({"name": "x", "mode": "mop", "model": "m:f", "dataset": {"name": "digits"}})
    spec = _spec("toomany", mop={"partitions": 100000, "param_grid": {"hidden": [8]}})
    with pytest.raises(SpecError, match="100000 partitions but only"):
        run_job(spec, tmp_path / "run", live=False, search_path=REPO / "examples")
