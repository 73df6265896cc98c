"""Merges in Redis: arithmetic, idempotency, and no lost update under concurrency."""

from __future__ import annotations

import numpy as np
import pytest

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.core import merge_into
from boinc_dl.server.assimilator.store import JobStore
from tests.support.procs import process


def test_merge_arithmetic_and_idempotency(tiny_job) -> None:
    store, _spec, fp = tiny_job
    wc = np.full(fp.n_params, 2.0, np.float32)
    out = store.merge("0", "u0", lambda ws: merge_into(ws, wc, 0.75), {"x": 1}, epoch=1)
    assert out.applied and out.version == 1
    w, v = store.get_weights("0")
    assert v == 1 and np.allclose(w, 0.5)  # 0.75*0 + 0.25*2
    again = store.merge("0", "u0", lambda ws: merge_into(ws, wc, 0.75), {"x": 1}, epoch=1)
    assert again.duplicate and not again.applied and again.version == 1
    assert np.allclose(store.get_weights("0")[0], 0.5)
    assert store.epoch_counts(1)["assimilated"] == 1
    merges = [m for m in store.metrics("merge")]
    assert [m["unit"] for m in merges] == ["u0"]


def test_alpha_zero_replaces(tiny_job) -> None:
    store, _spec, fp = tiny_job
    wc = np.arange(fp.n_params, dtype=np.float32)
    store.merge("0", "u1", lambda ws: merge_into(ws, wc, 0.0), {}, epoch=1)
    assert np.array_equal(store.get_weights("0")[0], wc)


def test_failed_unit_recorded_once(tiny_job) -> None:
    store, _spec, _fp = tiny_job
    assert store.mark_failed("u2", "too many errors", 1)
    assert not store.mark_failed("u2", "too many errors", 1)
    assert store.epoch_counts(1)["failed"] == 1
    assert store.unit_states()["u2"] == "failed"


def test_register_unit_idempotent(tiny_job) -> None:
    store, _spec, _fp = tiny_job
    before = store.epoch_counts(1)["created"]
    assert not store.register_unit("u0", {"epoch": 1, "shard": 0, "model": "0"}, 1)
    assert store.epoch_counts(1)["created"] == before


def _merge_worker(url: str, job: str, units: list[str], alpha: float, strict: bool, c: float) -> None:
    store = JobStore(connect(url), job)
    n = len(store.fingerprint("0").tensors) and store.fingerprint("0").n_params
    wc = np.full(n, c, np.float32)
    for u in units:
        store.merge("0", u, lambda ws: merge_into(ws, wc, alpha), {}, epoch=1, strict=strict)


def _run_concurrent(store: JobStore, url: str, n_units: int, procs: int, alpha: float, strict: bool) -> None:
    units = [f"c{i}" for i in range(n_units)]
    for u in units:
        store.register_unit(u, {"epoch": 1, "shard": 0, "model": "0"}, 1)
    ps = [process(_merge_worker, url, store.job, units[i::procs], alpha, strict, 1.0)
          for i in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(60)
        assert p.exitcode == 0


def _expected(n: int, alpha: float, size: int) -> np.ndarray:
    w = np.zeros(size, np.float32)
    c = np.ones(size, np.float32)
    for _ in range(n):
        merge_into(w, c, alpha)
    return w


def test_concurrent_strict_merges_lose_nothing(tiny_job, redis_server) -> None:
    """4 processes x 50 merges of W_c = c: W_s = a^n W_0 + (1 - a^n) c whatever the order."""
    store, _spec, fp = tiny_job
    _run_concurrent(store, redis_server.url, 200, 4, 0.99, strict=True)
    w, v = store.get_weights("0")
    assert v == 200
    np.testing.assert_array_equal(w, _expected(200, 0.99, fp.n_params))
    assert np.allclose(w, 1 - 0.99**200, rtol=1e-4)
    assert len(store.assimilated()) == 200


def test_eventual_mode_may_lose_updates_but_marks_all(tiny_job, redis_server) -> None:
    store, _spec, fp = tiny_job
    _run_concurrent(store, redis_server.url, 200, 4, 0.99, strict=False)
    w, _v = store.get_weights("0")
    effective = np.log(1 - float(w[0])) / np.log(0.99)
    assert effective <= 200 + 1e-3
    assert len(store.assimilated()) == 200


@pytest.mark.parametrize("strict", [True, False])
def test_duplicate_under_concurrency_is_merged_once(tiny_job, redis_server, strict: bool) -> None:
    """Every process tries to merge the same unit: exactly one merge lands (strict)."""
    store, _spec, _fp = tiny_job
    ps = [process(_merge_worker, redis_server.url, store.job, ["u3"], 0.5, True, 1.0)
          for _ in range(4)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(30)
    assert store.version("0") == 1
    assert np.allclose(store.get_weights("0")[0], 0.5)
