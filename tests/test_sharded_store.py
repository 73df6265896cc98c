"""Sharded weights on one Redis and on a real 3-master Redis Cluster.

Concurrent strict merges lose nothing and apply nothing twice, shard by shard (every
client copy is the constant c, so each shard must end at ``a^n W0 + (1-a^n) c``);
an assimilator SIGKILLed between shards is finished by the retry without applying a
shard twice; a cluster master SIGKILLed and restarted on its AOF loses no
acknowledged merge. The cluster is started by the fixture: three ``redis-server
--cluster-enabled yes`` on free loopback ports, joined with ``redis-cli --cluster
create``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from boinc_dl.server.assimilator.connection import cluster_nodes, connect, is_cluster_url
from boinc_dl.server.assimilator.core import merge_into
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis, LocalRedisCluster
from boinc_dl.server.assimilator.shards import ShardLayout, shards_for
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.weights import fingerprint_of
from tests.support.audit import audit_job
from tests.support.chaos import merge_while_killing
from tests.support.procs import mp_context, process

N = 2000            # parameters of the test model
SHARD_BYTES = "800"  # -> 10 shards of 200 float32


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[LocalRedisCluster]:
    """One real 3-master Redis Cluster for the module's tests (each uses its own job)."""
    cl = LocalRedisCluster(tmp_path_factory.mktemp("cluster"), masters=3).start()
    yield cl
    cl.kill()


@pytest.fixture(params=["single", "cluster"])
def engine(request, tmp_path: Path, monkeypatch) -> Iterator[str]:
    """The URL of a real Redis or of the real 3-master Redis Cluster."""
    monkeypatch.setenv("BDL_SHARD_BYTES", SHARD_BYTES)
    if request.param == "cluster":
        yield request.getfixturevalue("cluster").url
        return
    srv = EmbeddedRedis(tmp_path / "redis").start()
    try:
        yield srv.url
    finally:
        srv.kill()


@pytest.fixture
def job_name(request) -> str:
    """A job name of its own per test (the cluster is shared by the module)."""
    return "sh" + str(abs(hash(request.node.nodeid)) % 10**8)


def _job(url: str, units: int, name: str) -> JobStore:
    store = JobStore(connect(url, wait_s=10), name)
    fp = fingerprint_of(["w"], [np.zeros(N, np.float32)])
    store.create("{}", "vcasgd", {"0": fp}, {})
    assert store.init_weights("0", np.zeros(N, np.float32))
    for i in range(units):
        store.register_unit(f"m{i}", {"epoch": 1, "shard": i, "model": "0"}, 1)
    return store


def _expected(n: int, alpha: float) -> np.ndarray:
    w = np.zeros(N, np.float32)
    c = np.ones(N, np.float32)
    for _ in range(n):
        merge_into(w, c, alpha)
    return w


@contextmanager
def _two_writers(tmp_path: Path, monkeypatch, name: str) -> Iterator[tuple[JobStore, JobStore]]:
    """Two stores (two assimilators) of one job of 6 units on a private Redis."""
    monkeypatch.setenv("BDL_SHARD_BYTES", SHARD_BYTES)
    srv = EmbeddedRedis(tmp_path / "r").start()
    try:
        yield _job(srv.url, 6, name), JobStore(connect(srv.url), name)
    finally:
        srv.kill()


def _merge_ones(st: JobStore, unit: str) -> None:
    """Merge an all-ones result with alpha 0.5; it must apply."""
    wc = np.ones(N, np.float32)
    assert st.merge("0", unit, lambda ws, sl: merge_into(ws, wc[sl], 0.5), {}, 1).applied


def _merger(url: str, job: str, units: list[str], alpha: float, strict: bool, acks: mp.Queue | None = None,
            kill_after: int | None = None) -> None:
    def crash(n: int) -> None:  # a real crash right after the k-th shard's commit: no reply, no cleanup
        if kill_after is not None and n >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    store = JobStore(connect(url, wait_s=30), job, retry_s=30, on_shard_applied=crash)
    wc = np.ones(N, np.float32)
    for u in units:
        out = store.merge("0", u, lambda ws, sl: merge_into(ws, wc[sl], alpha), {}, epoch=1, strict=strict)
        if acks is not None and out.applied:
            acks.put(u)


def _run(url: str, job: str, units: list[str], procs: int, alpha: float, strict: bool) -> None:
    ps = [process(_merger, url, job, units[i::procs], alpha, strict) for i in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(60)
        assert p.exitcode == 0


def test_layout() -> None:
    assert shards_for(15, 1_310_720) == 1
    assert shards_for(4_972_746, 1_310_720) == 16
    lay = ShardLayout(2001, 10)
    cuts = [lay.bounds(i) for i in range(10)]
    assert cuts[0].start == 0 and cuts[-1].stop == 2001
    assert all(a.stop == b.start for a, b in zip(cuts, cuts[1:], strict=False))


def test_concurrent_strict_merges_exact_per_shard(engine, job_name: str) -> None:
    url = engine
    store = _job(url, 60, job_name)
    assert store.layout("0").shards == 10
    _run(url, job_name, [f"m{i}" for i in range(60)], 4, 0.99, strict=True)
    snap = store.snapshot("0")
    assert snap.shard_versions == [60] * 10 and store.version("0") == 60
    np.testing.assert_array_equal(snap.flat, _expected(60, 0.99))
    assert len(store.assimilated()) == 60 and store.epoch_counts(1)["assimilated"] == 60


def test_eventual_mode_marks_all_and_never_exceeds(engine, job_name: str) -> None:
    url = engine
    store = _job(url, 60, job_name)
    _run(url, job_name, [f"m{i}" for i in range(60)], 4, 0.99, strict=False)
    snap = store.snapshot("0")
    landed = np.log(1 - snap.flat.astype(np.float64)) / np.log(0.99)
    assert float(landed.max()) <= 60 + 1e-2
    assert len(store.assimilated()) == 60 and store.version("0") == 60


def test_same_unit_from_four_processes_applies_once(engine, job_name: str) -> None:
    url = engine
    store = _job(url, 1, job_name)
    _run(url, job_name, ["m0"] * 4, 4, 0.5, strict=True)
    snap = store.snapshot("0")
    assert snap.shard_versions == [1] * 10 and store.version("0") == 1
    assert np.allclose(snap.flat, 0.5)
    assert [m["unit"] for m in store.metrics("merge")] == ["m0"]


@pytest.mark.parametrize("k", [1, 6])
def test_assimilator_killed_between_shards_is_finished_by_the_retry(engine, job_name: str, k: int) -> None:
    """A real process SIGKILLs itself after committing k of 10 shards; the retry (a new
    process) applies the other shards only, then the unit's global mark, once."""
    url = engine
    store = _job(url, 2, job_name)
    p = process(_merger, url, job_name, ["m0"], 0.5, True, None, k)
    p.start()
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    half = store.snapshot("0")
    assert sorted(half.shard_versions) == [0] * (10 - k) + [1] * k
    assert not store.is_assimilated("m0") and store.version("0") == 0
    _run(url, job_name, ["m0", "m1"], 1, 0.5, strict=True)
    snap = store.snapshot("0")
    assert snap.shard_versions == [2] * 10 and store.version("0") == 2
    np.testing.assert_array_equal(snap.flat, _expected(2, 0.5))
    assert store.epoch_counts(1)["assimilated"] == 2
    assert [m["unit"] for m in store.metrics("merge")] == ["m0", "m1"]


def test_cluster_master_killed_and_restarted_loses_no_acknowledged_merge(tmp_path: Path, monkeypatch) -> None:
    """4 processes merge 80 units into a 10-shard model on a 3-master cluster; one
    master is SIGKILLed and restarted on its AOF and nodes.conf twice: every
    acknowledged merge survives, every shard carries each unit exactly once."""
    monkeypatch.setenv("BDL_SHARD_BYTES", SHARD_BYTES)
    cl = LocalRedisCluster(tmp_path / "cluster", masters=3).start()
    try:
        n = 80
        store = _job(cl.url, n, "sharded")
        ctx = mp_context()
        acks: mp.Queue = ctx.Queue()
        units = [f"m{i}" for i in range(n)]
        ps = [process(_merger, cl.url, "sharded", units[i::4], 0.99, True, acks) for i in range(4)]
        acked = merge_while_killing(ps, acks, _kill_master(cl), every=20, deadline_s=60, join_s=30)
        cl.wait_ok()
        store = JobStore(connect(cl.url), "sharded")
        assert set(store.assimilated()) == acked == set(units)
        snap = store.snapshot("0")
        assert snap.shard_versions == [n] * 10
        np.testing.assert_array_equal(snap.flat, _expected(n, 0.99))
        audit = audit_job(store, n_subsets=n)
        assert audit.ok, audit.problems
    finally:
        cl.kill()


def _kill_master(cl: LocalRedisCluster) -> Callable[[int, set[str]], None]:
    """SIGKILL and restart a different master each time."""
    def kill(k: int, _acked: set[str]) -> None:
        victim = cl.nodes[k % 3]
        victim.kill()
        time.sleep(0.3)
        victim.restart()
    return kill


def _logged_merger(url: str, units: list[str], files: str, acks: mp.Queue) -> None:
    from tests.test_merge_log import merge_file

    store = JobStore(connect(url, wait_s=30), "lj", retry_s=30)
    for u in units:
        if merge_file(store, Path(files) / f"{u}.h5", u) == "merged":
            acks.put(u)


def test_cluster_master_rebuilds_its_shards_from_its_own_log(tmp_path: Path, monkeypatch) -> None:
    """Logged merges (shard bytes out of the AOF) on a 3-master cluster: 4 processes
    merge 60 results while masters are SIGKILLed and restarted twice; each restarted
    master's shards are rebuilt from the marks in its own AOF (and the retained inputs),
    every acknowledged merge survives, every shard holds each unit once. Then the master
    of shard 0 is killed once more: exactly its shards are rebuilt, bit for bit."""
    from boinc_dl.server.assimilator.recovery import ensure_live
    from boinc_dl.server.common.weights import WeightsFile, write_weights
    from tests.test_merge_log import ALPHA, FP, new_job
    from tests.test_merge_log import SHARD_BYTES as LSB
    from tests.test_merge_log import N as LN

    monkeypatch.setenv("BDL_SHARD_BYTES", LSB)
    monkeypatch.setenv("BDL_SNAPSHOT_EVERY", "25")
    cl = LocalRedisCluster(tmp_path / "cluster", masters=3).start()
    try:
        n = 60
        store = new_job(cl.url, tmp_path / "job", units=n)
        files = tmp_path / "r"
        files.mkdir()
        for i in range(n):
            write_weights(files / f"u{i}.h5", WeightsFile(np.ones(LN, np.float32), FP, job="lj", model="0", unit=f"u{i}"))
        ctx = mp_context()
        acks: mp.Queue = ctx.Queue()
        units = [f"u{i}" for i in range(n)]
        ps = [process(_logged_merger, cl.url, units[k::4], str(files), acks) for k in range(4)]
        acked = merge_while_killing(ps, acks, _kill_master(cl), every=15, deadline_s=120, join_s=60)
        cl.wait_ok()
        store = JobStore(connect(cl.url), "lj")
        assert set(store.assimilated()) == acked == set(units)
        w = np.linspace(-1, 1, LN, dtype=np.float32)
        for _ in range(n):
            merge_into(w, np.ones(LN, np.float32), ALPHA)
        before = store.snapshot("0")
        assert before.shard_versions == [n] * 4 and before.flat.tobytes() == w.tobytes()
        assert audit_job(store, n_subsets=1000).ok
        # The master of shard 0 once more: it rebuilds its shards, and only those.
        port = store.r.get_node_from_key(store._shard_keys("0", 0)[0]).port
        victim = next(nd for nd in cl.nodes if nd.port == port)
        mine = [i for i in range(4) if store.r.get_node_from_key(store._shard_keys("0", i)[0]).port == port]
        victim.kill()
        victim.restart()
        cl.wait_ok()
        again = JobStore(connect(cl.url, wait_s=10), "lj")
        report = ensure_live(again, "0")
        assert report is not None and report.shards == mine
        assert again.snapshot("0").flat.tobytes() == w.tobytes()
    finally:
        cl.kill()


def test_one_key_layout_is_migrated(tmp_path: Path, monkeypatch) -> None:
    """Weights stored by an earlier release as one value are cut into shards on first
    use, at their version; merges then go on from there."""
    monkeypatch.setenv("BDL_SHARD_BYTES", SHARD_BYTES)
    srv = EmbeddedRedis(tmp_path / "r").start()
    try:
        store = JobStore(connect(srv.url), "sharded")
        fp = fingerprint_of(["w"], [np.zeros(N, np.float32)])
        store.create("{}", "vcasgd", {"0": fp}, {})
        old = np.arange(N, dtype=np.float32)
        store.r.set(store.k("w", "0"), old.tobytes())
        store.r.set(store.k("v", "0"), 7)
        store.register_unit("m0", {"epoch": 1, "model": "0"}, 1)
        assert not store.init_weights("0", np.zeros(N, np.float32))  # never overwrites
        snap = JobStore(connect(srv.url), "sharded").snapshot("0")
        np.testing.assert_array_equal(snap.flat, old)
        assert snap.shard_versions == [7] * 10 and not store.r.exists(store.k("w", "0"))
        out = store.merge("0", "m0", lambda ws, sl: merge_into(ws, np.zeros(N, np.float32)[sl], 0.5), {}, 1)
        assert out.applied and out.version == 8
        np.testing.assert_array_equal(store.snapshot("0").flat, old * 0.5)
    finally:
        srv.kill()


def test_cluster_urls() -> None:
    assert cluster_nodes("redis+cluster://10.0.0.1:7000,10.0.0.2:7001/") == (
        [("10.0.0.1", 7000), ("10.0.0.2", 7001)], None)
    assert cluster_nodes("redis+cluster://:s3cret@h:7000") == ([("h", 7000)], "s3cret")
    assert cluster_nodes("redis://a:1,redis://b:2") == ([("a", 1), ("b", 2)], None)
    assert is_cluster_url("redis://a:1,redis://b:2") and not is_cluster_url("redis://a:1/0")
    with pytest.raises(ValueError):
        cluster_nodes("redis+cluster://")


def test_list_of_node_urls_reaches_the_cluster(cluster: LocalRedisCluster) -> None:
    url = ",".join(f"redis://127.0.0.1:{n.port}" for n in cluster.nodes)
    store = JobStore(connect(url), "listed")
    assert store.cluster and store.k("meta") == "bdl:{listed}:meta"
    store.set_meta(x=1)
    assert JobStore(connect(cluster.url), "listed").meta()["x"] == "1"


def test_cached_fast_path_and_a_second_writer(tmp_path: Path, monkeypatch) -> None:
    """A lone assimilator merges from its cached shards in one pipelined round trip;
    another writer in between makes its cache stale, and the merge re-reads: every
    shard still ends at the exact value."""
    with _two_writers(tmp_path, monkeypatch, "fast") as (a, b):
        _merge_ones(a, "m0")
        assert len(a._cache) == 10  # every shard cached: the next merge takes the fast path
        _merge_ones(a, "m1")
        _merge_ones(b, "m2")        # a's cache is now stale everywhere
        _merge_ones(a, "m3")
        _merge_ones(a, "m4")
        snap = b.snapshot("0")
        assert snap.shard_versions == [5] * 10
        np.testing.assert_array_equal(snap.flat, _expected(5, 0.5))
        wc = np.ones(N, np.float32)
        assert not a.merge("0", "m4", lambda ws, sl: merge_into(ws, wc[sl], 0.5), {}, 1).applied


@pytest.mark.parametrize("warm", [True, False], ids=["cached-fast-path", "shard-by-shard"])
def test_a_write_between_watch_and_commit_aborts_and_is_retried(tmp_path: Path, monkeypatch, warm: bool) -> None:
    """Another assimilator commits a shard while this one is computing it (after its
    WATCH, before its EXEC): the commit is aborted, the shard re-read and merged again,
    and every shard ends at exactly four merges, whichever path the merge took."""
    monkeypatch.setenv("BDL_SHARD_BYTES", SHARD_BYTES)
    srv = EmbeddedRedis(tmp_path / "r").start()
    try:
        a = _job(srv.url, 6, "race")
        b = JobStore(connect(srv.url), "race")
        wc = np.ones(N, np.float32)
        for u in ("m0", "m0b"):  # the second finds every cached shard current: a is alone
            assert a.merge("0", u, lambda ws, sl: merge_into(ws, wc[sl], 0.5), {}, 1).applied
        assert a._alone["0"]
        if not warm:
            a = JobStore(connect(srv.url), "race")  # no cached shard: read shard by shard
        calls = []

        def racing(ws: np.ndarray, sl: slice) -> np.ndarray:
            if not calls:  # the first shard computed: b merges its unit meanwhile
                assert b.merge("0", "m1", lambda w2, s2: merge_into(w2, wc[s2], 0.5), {}, 1).applied
            calls.append(sl.start)
            return merge_into(ws, wc[sl], 0.5)
        out = a.merge("0", "m2", racing, {}, 1)
        assert out.applied and not out.duplicate
        assert len(calls) > 10  # some shard was computed again after the abort
        if not warm:
            assert out.retries >= 1
        snap = b.snapshot("0")
        assert snap.shard_versions == [4] * 10
        np.testing.assert_array_equal(snap.flat, _expected(4, 0.5))
    finally:
        srv.kill()


def test_a_give_up_landing_while_shards_are_applied_keeps_the_accounting(tmp_path: Path, monkeypatch) -> None:
    """The unit is given up (BOINC's error path, another daemon) after the merge's
    first check and before its final mark: the final mark refuses it, so the unit is
    failed only, the epoch counts it once, and the late merge is on the record."""
    monkeypatch.setenv("BDL_SHARD_BYTES", SHARD_BYTES)
    srv = EmbeddedRedis(tmp_path / "r").start()
    try:
        a = _job(srv.url, 3, "late")  # units m0..m2
        other = JobStore(connect(srv.url), "late")
        wc = np.ones(N, np.float32)

        def giving_up(ws: np.ndarray, sl: slice) -> np.ndarray:
            other.mark_failed("m1", "too many errors", 1)
            return merge_into(ws, wc[sl], 0.5)
        out = a.merge("0", "m1", giving_up, {}, 1)
        assert out.given_up and not out.applied
        assert "m1" not in a.assimilated() and "m1" in a.failed()
        assert a.unit_states()["m1"] == "failed"
        counts = a.epoch_counts(1)
        assert counts.get("failed") == 1 and not counts.get("assimilated")
        assert [m["unit"] for m in a.metrics("late_merge")] == ["m1"]
        assert not a.mark_failed("m1", "again", 1)  # still counted once
    finally:
        srv.kill()


def test_a_merge_after_a_snapshot_reads_no_shard_bytes_again(tmp_path: Path, monkeypatch) -> None:
    """The assimilator reads a snapshot (the distance check), then merges: the merge's
    reads skip the bytes of every shard whose tag has not moved since, and re-read the
    ones another assimilator wrote in between. Every shard ends exact either way."""
    with _two_writers(tmp_path, monkeypatch, "snap") as (a, b):
        def gets() -> int:
            return int(a.r.info("commandstats").get("cmdstat_get", {}).get("calls", 0))
        _merge_ones(b, "m0")                    # written by another process: a holds nothing
        np.testing.assert_array_equal(a.snapshot("0").flat, _expected(1, 0.5))
        before = gets()
        _merge_ones(a, "m1")
        assert gets() == before                 # the snapshot's bytes served the merge
        a.snapshot("0")
        _merge_ones(b, "m2")                    # every shard moves after a's snapshot
        before = gets()
        _merge_ones(a, "m3")
        assert gets() - before == 10            # stale: each shard's bytes read again
        snap = b.snapshot("0")
        assert snap.shard_versions == [4] * 10
        np.testing.assert_array_equal(snap.flat, _expected(4, 0.5))
