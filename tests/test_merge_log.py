"""Durable merges through the merge log: the shard bytes stay out of Redis's AOF, and a
Redis SIGKILLed and restarted gets them back from the newest snapshot and the log,
bitwise identical.

Real Redis servers, real HDF5 result files through the one assimilation path, real
processes. Every test compares bytes: the weights read before Redis was killed
against the weights served after it restarted.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from boinc_dl.server.assimilator import snapshot as snaps
from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.core import merge_into
from boinc_dl.server.assimilator.mergelog import parse_records
from boinc_dl.server.assimilator.recovery import RecoveryError, ensure_live
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.spec import JobSpec, parse_spec
from boinc_dl.server.common.weights import WeightsFile, fingerprint_of, write_weights
from tests.support.audit import audit_job
from tests.support.procs import process
from tests.support.results import assimilate_files, finish_retained

N = 2000
SHARD_BYTES = "2000"  # -> 4 shards of 500 float32
ALPHA = 0.9


def make_spec(name: str = "lj") -> JobSpec:
    return parse_spec({"name": name, "model": "m:f", "dataset": {"name": "digits"},
                       "vcasgd": {"alpha": ALPHA, "merge_rule": "paper", "n_subsets": 1000},
                       "units": {"max_upload_bytes": 10**8}})


FP = fingerprint_of(["w"], [np.zeros(N, np.float32)])


def new_job(url: str, job_dir: Path, name: str = "lj", units: int = 0) -> JobStore:
    """A job with a durable dir (``job_dir``), its weights at version 0, units u0.."""
    store = JobStore(connect(url, wait_s=10), name)
    store.create(make_spec(name).model_dump_json(), "vcasgd", {"0": FP}, {"job_dir": str(job_dir)})
    store.init_weights("0", np.linspace(-1, 1, N, dtype=np.float32))
    for i in range(units):
        store.register_unit(f"u{i}", {"epoch": 1, "shard": i, "model": "0"}, 1)
    return store


def result_file(d: Path, job: str, unit: str, seed: int) -> Path:
    """A real result weights file of ``unit`` (random values from ``seed``)."""
    d.mkdir(parents=True, exist_ok=True)
    wc = np.random.default_rng(seed).standard_normal(N).astype(np.float32)
    p = d / f"{unit}.h5"
    write_weights(p, WeightsFile(wc, FP, job=job, model="0", unit=unit))
    return p


def merge_file(store: JobStore, path: Path, unit: str) -> str:
    """The job system's call: hand the result to the assimilation path; its status."""
    return assimilate_files(store, [path], make_spec(store.job), unit=unit).status


def log_entry(store: JobStore, unit: str) -> dict:
    """The unit's entry in the model's merge log."""
    return json.loads(store.r.hget(store.mlog_key("0"), unit))


def input_sha(store: JobStore, unit: str) -> str | None:
    """The SHA-256 the log records for the unit's input (None until hashed)."""
    v = store.r.hget(store.mrec_key("0"), f"s:{unit}")
    return v.decode() if v is not None else None


def retained_path(store: JobStore, job_dir: Path, unit: str) -> Path:
    return job_dir / "durable" / "inputs" / "0" / f"{unit}.{log_entry(store, unit)['f']}.h5"


def aof_bytes(data_dir: Path) -> int:
    return sum(os.path.getsize(f) for f in glob.glob(str(data_dir / "appendonly*")) +
               glob.glob(str(data_dir / "appendonlydir" / "*")))


@pytest.fixture
def env(tmp_path: Path, monkeypatch) -> Iterator[tuple[EmbeddedRedis, Path]]:
    monkeypatch.setenv("BDL_SHARD_BYTES", SHARD_BYTES)
    monkeypatch.setenv("BDL_SNAPSHOT_EVERY", "100000")  # snapshots only where a test takes them
    srv = EmbeddedRedis(tmp_path / "redis").start()
    try:
        yield srv, tmp_path
    finally:
        srv.kill()


def _restart(srv: EmbeddedRedis, name: str = "lj") -> JobStore:
    srv.kill()
    srv.restart()
    return JobStore(connect(srv.url, wait_s=10), name)


def _worker(url: str, job: str, units: list[str], files: str) -> None:
    store = JobStore(connect(url, wait_s=30), job, retry_s=30)
    for u in units:
        assert merge_file(store, Path(files) / f"{u}.h5", u) == "merged"


def test_logged_merges_keep_the_bytes_out_of_the_aof_and_come_back_bitwise(env) -> None:
    """Two processes merge 40 results (their shards interleave); Redis is SIGKILLed: the
    weights served after the restart are the very bytes served before it."""
    srv, tmp = env
    store = new_job(srv.url, tmp / "job", units=40)
    for i in range(40):
        result_file(tmp / "results", "lj", f"u{i}", i)
    aof_before = aof_bytes(tmp / "redis")
    units = [f"u{i}" for i in range(40)]
    ps = [process(_worker, srv.url, "lj", units[k::2], str(tmp / "results")) for k in range(2)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(120)
        assert p.exitcode == 0
    before = store.snapshot("0")
    assert before.shard_versions == [40] * 4 and store.version("0") == 40
    # The AOF grew by the log and the bookkeeping (about 3 KB per merge of 4 shards),
    # not by 40 x 8 KB of shard bytes.
    grown = aof_bytes(tmp / "redis") - aof_before
    # (3.4 KB: the merge record carries the merge's own durations since issue #24.)
    assert grown < 40 * 3400, grown
    entry = log_entry(store, "u7")
    assert entry["rule"] == "merge" and entry["params"]["rule"]["name"] == "paper"
    assert entry["params"]["rule"]["alpha"] == ALPHA and entry["params"]["scale"] == 1.0
    assert len(input_sha(store, "u7") or "") == 64  # added by the worker's hashing thread
    # The versions u7 produced: its mark in every shard, and the commit records that log them.
    marks = [int(store.r.hget(store._shard_keys("0", i)[1], "u:u7")) for i in range(4)]
    assert all(1 <= v <= 40 for v in marks)
    records, _ = parse_records(store.r.hgetall(store.mrec_key("0")))
    assert [records[i][marks[i]] for i in range(4)] == ["u7"] * 4
    assert retained_path(store, tmp / "job", "u7").is_file()
    after_store = _restart(srv)
    after = after_store.snapshot("0")
    assert after.flat.tobytes() == before.flat.tobytes()
    assert after.shard_versions == before.shard_versions
    assert audit_job(after_store, n_subsets=1000).ok


def test_recovery_is_the_sequential_merge_bit_for_bit(env) -> None:
    """One process, in order: the rebuilt weights equal numpy's merges of the same files."""
    srv, tmp = env
    store = new_job(srv.url, tmp / "job", units=12)
    expect = np.linspace(-1, 1, N, dtype=np.float32)
    for i in range(12):
        p = result_file(tmp / "results", "lj", f"u{i}", 100 + i)
        assert merge_file(store, p, f"u{i}") == "merged"
        p.unlink()  # the job system's cleanup: the retained name keeps the data
        wc = np.random.default_rng(100 + i).standard_normal(N).astype(np.float32)
        for k in range(4):
            sl = slice(N * k // 4, N * (k + 1) // 4)
            merge_into(expect[sl], wc[sl], ALPHA)
    assert store.snapshot("0").flat.tobytes() == expect.tobytes()
    assert _restart(srv).snapshot("0").flat.tobytes() == expect.tobytes()


def test_a_snapshot_truncates_the_log_and_recovery_starts_from_it(env) -> None:
    srv, tmp = env
    store = new_job(srv.url, tmp / "job", units=20)
    for i in range(12):
        assert merge_file(store, result_file(tmp / "r", "lj", f"u{i}", i), f"u{i}") == "merged"
    m = snaps.take(store, "0")
    assert m is not None and m.versions == [12] * 4
    assert store.r.hlen(store.mlog_key("0")) == 0
    assert list((tmp / "job" / "durable" / "inputs" / "0").iterdir()) == []
    for i in range(12, 20):
        assert merge_file(store, result_file(tmp / "r", "lj", f"u{i}", i), f"u{i}") == "merged"
    assert store.r.hlen(store.mlog_key("0")) == 8
    before = store.snapshot("0").flat.tobytes()
    after_store = _restart(srv)
    report = ensure_live(after_store, "0")
    assert report is not None and report.merges == 8 and set(report.bases.values()) == {"snapshot@12"}
    assert after_store.snapshot("0").flat.tobytes() == before


def test_recovery_after_an_aof_rewrite_starts_from_its_copy(env) -> None:
    """A rewritten AOF holds the bytes of its moment: the replay goes on from there."""
    srv, tmp = env
    store = new_job(srv.url, tmp / "job", units=10)
    for i in range(5):
        assert merge_file(store, result_file(tmp / "r", "lj", f"u{i}", i), f"u{i}") == "merged"
    store.r.bgrewriteaof()
    while store.r.info("persistence")["aof_rewrite_in_progress"]:
        pass
    for i in range(5, 10):
        assert merge_file(store, result_file(tmp / "r", "lj", f"u{i}", i), f"u{i}") == "merged"
    before = store.snapshot("0").flat.tobytes()
    after_store = _restart(srv)
    report = ensure_live(after_store, "0")
    assert report is not None and set(report.bases.values()) == {"redis@5"} and report.merges == 5
    assert after_store.snapshot("0").flat.tobytes() == before


def test_an_input_on_another_filesystem_is_copied(env, tmp_path: Path) -> None:
    srv, tmp = env
    if not Path("/dev/shm").is_dir() or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem here")
    store = new_job(srv.url, tmp / "job", units=3)
    other = Path(f"/dev/shm/bdl-test-{os.getpid()}-{os.urandom(3).hex()}")
    try:
        for i in range(3):
            assert merge_file(store, result_file(other, "lj", f"u{i}", i), f"u{i}") == "merged"
    finally:
        shutil.rmtree(other, ignore_errors=True)  # the uploads are gone; the copies are not
    before = store.snapshot("0").flat.tobytes()
    assert _restart(srv).snapshot("0").flat.tobytes() == before


def test_a_lost_input_stops_recovery_until_it_is_back(env) -> None:
    srv, tmp = env
    store = new_job(srv.url, tmp / "job", units=3)
    for i in range(3):
        assert merge_file(store, result_file(tmp / "r", "lj", f"u{i}", i), f"u{i}") == "merged"
    before = store.snapshot("0").flat.tobytes()
    lost = retained_path(store, tmp / "job", "u1")
    aside = tmp / "aside.h5"
    lost.rename(aside)
    after_store = _restart(srv)
    after_store.retry_s = 0.5
    with pytest.raises(RecoveryError, match="u1"):
        ensure_live(after_store, "0")
    aside.rename(lost)
    assert after_store.snapshot("0").flat.tobytes() == before


def test_a_damaged_input_is_refused(env) -> None:
    srv, tmp = env
    store = new_job(srv.url, tmp / "job", units=2)
    for i in range(2):
        assert merge_file(store, result_file(tmp / "r", "lj", f"u{i}", i), f"u{i}") == "merged"
    finish_retained(tmp)  # the SHA-256 is recorded off the merge's critical path
    assert len(input_sha(store, "u0") or "") == 64
    path = retained_path(store, tmp / "job", "u0")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.unlink()
    path.write_bytes(bytes(data))
    with pytest.raises(RecoveryError, match="SHA-256"):
        ensure_live(_restart(srv), "0")


def test_a_second_result_of_a_unit_finishes_the_first_ones_merge(env) -> None:
    """The first result of u0 logged its intent and merged 2 of 4 shards, then its
    assimilator died; a different result of u0 arrives: u0 is merged from the first
    result's bytes on every shard, once."""
    srv, tmp = env
    store = new_job(srv.url, tmp / "job", units=2)
    first = result_file(tmp / "a", "lj", "u0", 1)

    def crash_after_two(n: int) -> None:
        if n >= 2:
            raise KeyboardInterrupt  # stands in for the process dying: nothing after it runs
    dying = JobStore(connect(srv.url), "lj", on_shard_applied=crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        merge_file(dying, first, "u0")
    second = result_file(tmp / "b", "lj", "u0", 2)
    out = assimilate_files(store, [second], make_spec(), unit="u0")
    assert out.status == "merged"
    rec = store.assimilated()["u0"]
    assert rec["helped"] and store.snapshot("0").shard_versions == [1] * 4
    expect = np.linspace(-1, 1, N, dtype=np.float32)
    merge_into(expect, np.random.default_rng(1).standard_normal(N).astype(np.float32), ALPHA)
    assert store.snapshot("0").flat.tobytes() == expect.tobytes()
    assert _restart(srv).snapshot("0").flat.tobytes() == expect.tobytes()


def test_a_rejected_result_leaves_no_retained_file(env) -> None:
    srv, tmp = env
    store = new_job(srv.url, tmp / "job", units=1)
    bad = tmp / "bad.h5"
    write_weights(bad, WeightsFile(np.full(N, np.nan, np.float32), FP, job="lj", model="0", unit="u0"))
    assert assimilate_files(store, [bad], make_spec(), unit="u0").status == "rejected"
    area = tmp / "job" / "durable" / "inputs" / "0"
    assert not area.exists() or list(area.iterdir()) == []
    assert store.r.hlen(store.mlog_key("0")) == 0


def test_a_job_without_a_directory_logs_its_bytes_as_before(env) -> None:
    srv, tmp = env
    store = JobStore(connect(srv.url), "plain")
    store.create(make_spec("plain").model_dump_json(), "vcasgd", {"0": FP}, {})
    store.init_weights("0", np.zeros(N, np.float32))
    store.register_unit("u0", {"epoch": 1, "shard": 0, "model": "0"}, 1)
    assert merge_file(store, result_file(tmp / "r", "plain", "u0", 0), "u0") == "merged"
    assert store.r.hlen(store.mlog_key("0")) == 0
    before = store.snapshot("0").flat.tobytes()
    assert _restart(srv, "plain").snapshot("0").flat.tobytes() == before


def test_snapshots_start_in_the_background_when_the_log_is_long(env, monkeypatch) -> None:
    srv, tmp = env
    monkeypatch.setenv("BDL_SNAPSHOT_EVERY", "5")
    store = new_job(srv.url, tmp / "job", units=6)
    for i in range(5):
        assert merge_file(store, result_file(tmp / "r", "lj", f"u{i}", i), f"u{i}") == "merged"
    for t in list(snaps._running.values()):
        t.join(30)
    m = snaps.manifest(store, "0")
    assert m is not None and m.versions == [5] * 4
    assert json.loads(store.r.hget(store.k("snapshots"), "0"))["versions"] == [5] * 4
    assert store.r.hlen(store.mlog_key("0")) == 0

