"""The merge log's commit records (one Redis): what a merge adds to the append-only file,
interleaved merges cut short by a crash, and replays that never apply an entry twice.

Real Redis servers, real HDF5 result files through the one assimilation path. The AOF
is read back command by command (its bytes counted, not timed); the weights are
compared bytes for bytes against numpy's merges in each shard's own order.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from boinc_dl.server.assimilator import retained
from boinc_dl.server.assimilator.aof_sync import aof_files
from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.core import merge_into
from boinc_dl.server.assimilator.mergelog import parse_records
from boinc_dl.server.assimilator.merging import _Held
from boinc_dl.server.assimilator.recovery import ensure_live
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.errors import StoreUnavailable
from boinc_dl.server.common.spec import parse_spec
from boinc_dl.server.common.weights import WeightsFile, fingerprint_of, write_weights
from tests.support.results import assimilate_files, finish_retained
from tests.test_merge_log import ALPHA, SHARD_BYTES, N, merge_file, new_job, result_file

#: The bound the log may add to the AOF per merge of a 16-shard model (the intent, the
#: input's SHA-256, the commit record).
LOG_BYTES_PER_MERGE = 1024


def _commands(data: bytes) -> list[tuple[int, list[bytes]]]:
    """An AOF's commands (RESP arrays) with the bytes each takes."""
    out, pos = [], 0
    while pos < len(data):
        assert data[pos:pos + 1] == b"*", f"not a command at byte {pos}"
        start = pos
        end = data.index(b"\r\n", pos)
        n = int(data[pos + 1:end])
        pos = end + 2
        args = []
        for _ in range(n):
            end = data.index(b"\r\n", pos)
            size = int(data[pos + 1:end])
            pos = end + 2
            args.append(data[pos:pos + size])
            pos += size + 2
        out.append((pos - start, args))
    return out


def _aof(data_dir: Path) -> bytes:
    # The incremental file(s) in Redis 7's AOF dir, the one file in Redis 6.
    return b"".join(p.read_bytes() for p in aof_files(data_dir)
                    if p.name == "appendonly.aof" or p.name.endswith(".incr.aof"))


def _blocks(cmds: list[tuple[int, list[bytes]]]) -> list[list[tuple[int, list[bytes]]]]:
    """Commands grouped as Redis wrote them: a MULTI..EXEC block (one script's or
    transaction's writes) or a lone command."""
    blocks, cur = [], None
    for c in cmds:
        name = c[1][0].upper()
        if name == b"MULTI":
            cur = [c]
        elif cur is not None:
            cur.append(c)
            if name == b"EXEC":
                blocks.append(cur)
                cur = None
        else:
            blocks.append([c])
    return blocks


@pytest.fixture
def redis_dir(tmp_path: Path) -> Iterator[tuple[EmbeddedRedis, Path]]:
    srv = EmbeddedRedis(tmp_path / "redis").start()
    try:
        yield srv, tmp_path
    finally:
        srv.kill()


def test_a_merge_of_a_16_shard_model_logs_under_a_kilobyte(redis_dir, monkeypatch) -> None:
    """The paper's shape (16 shards, the default merge rule's parameters, a job and its
    units named as the work generator names them): after the first merge, each merge
    adds to the AOF one intent, one SHA-256 and one commit record, under 1 KB together,
    and nothing on any shard's hash; the bytes of every command are counted."""
    srv, tmp = redis_dir
    n = 16 * 1000
    monkeypatch.setenv("BDL_SHARD_BYTES", str(n * 4 // 16))
    monkeypatch.setenv("BDL_SNAPSHOT_EVERY", "100000")
    job = "paper-resnet-vcasgd"
    spec = parse_spec({"name": job, "model": "m:f", "dataset": {"name": "digits"},
                       "vcasgd": {"alpha": 0.95, "n_subsets": 1000}, "units": {"max_upload_bytes": 10**8}})
    fp = fingerprint_of(["w"], [np.zeros(n, np.float32)])
    store = JobStore(connect(srv.url), job)
    store.create(spec.model_dump_json(), "vcasgd", {"0": fp}, {"job_dir": str(tmp / "job")})
    store.init_weights("0", np.zeros(n, np.float32))
    assert store.layout("0").shards == 16
    units = [f"{job}__m0_e0001_s{i:04d}" for i in range(12)]
    for i, u in enumerate(units):
        store.register_unit(u, {"epoch": 1, "shard": i, "model": "0"}, 1)
    log_keys = {store.mlog_key("0").encode(), store.mrec_key("0").encode()}
    shard_keys = {k.encode() for i in range(16) for k in store._shard_keys("0", i)}
    per_merge: list[tuple[int, int, int]] = []  # (log bytes, shard-hash bytes, all bytes)
    for i, u in enumerate(units):
        p = tmp / "r" / f"{u}.h5"
        p.parent.mkdir(exist_ok=True)
        wc = np.random.default_rng(i).standard_normal(n).astype(np.float32)
        write_weights(p, WeightsFile(wc, fp, job=job, model="0", unit=u))
        before = len(_aof(tmp / "redis"))
        assert assimilate_files(store, [p], spec, unit=u).status == "merged"
        finish_retained(tmp)  # the SHA-256 is recorded by the hashing thread
        log = shard = 0
        grown = _aof(tmp / "redis")[before:]
        for block in _blocks(_commands(grown)):
            size = sum(s for s, _ in block)
            keys = {args[1] for _, args in block if len(args) > 1}
            if keys and keys <= log_keys:
                log += size
            elif keys & shard_keys:
                shard += size
        per_merge.append((log, shard, len(grown)))
    steady = per_merge[1:]  # the first merge into a shard also logs its new epoch tag, once
    assert per_merge[0][1] > 0 and all(s == 0 for _, s, _ in steady), per_merge
    assert max(log for log, _, _ in steady) < LOG_BYTES_PER_MERGE, per_merge
    # Every shard's log names each merge once, in order; after the first merge (nothing
    # cached yet: shard by shard, as merges among others go) a lone assimilator commits
    # its 16 shards in two pipelined calls of 8, one record each (BDL_PIPELINED_COMMITS=0:
    # one call, one record per merge).
    records, shas = parse_records(store.r.hgetall(store.mrec_key("0")))
    assert set(shas) == set(units)
    assert all(records[i] == {v: units[v - 1] for v in range(1, 13)} for i in range(16))
    raw = {k.decode(): v.decode() for k, v in store.r.hgetall(store.mrec_key("0")).items()
           if not k.startswith(b"s:")}
    per_unit = Counter(k.partition(":")[2] for k in raw)
    assert per_unit == {units[0]: 16, **dict.fromkeys(units[1:], 2)}
    for u in units[1:]:
        halves = [v for k, v in raw.items() if k.partition(":")[2] == u]
        assert sorted(len(h.split(",")) for h in halves) == [8, 8], halves


def _expected_per_shard(orders: dict[int, list[int]]) -> bytes:
    """The weights after merging, into each shard, the results of the seeds in its order."""
    w = np.linspace(-1, 1, N, dtype=np.float32)
    for k, seeds in orders.items():
        sl = slice(N * k // 4, N * (k + 1) // 4)
        for s in seeds:
            merge_into(w[sl], np.random.default_rng(s).standard_normal(N).astype(np.float32)[sl], ALPHA)
    return w.tobytes()


def _shard_orders(store: JobStore, seed_of: dict[str, int]) -> dict[int, list[int]]:
    """Each shard's merges in version order, from the commit records (as seeds)."""
    records, _ = parse_records(store.r.hgetall(store.mrec_key("0")))
    return {i: [seed_of[records[i][v]] for v in sorted(records[i])] for i in range(4)}


def _dies_after(k: int) -> Callable[[int], None]:
    def hook(n: int) -> None:
        if n >= k:
            raise KeyboardInterrupt  # stands in for the process dying: nothing after it runs
    return hook


@pytest.fixture
def env(tmp_path: Path, monkeypatch) -> Iterator[tuple[EmbeddedRedis, Path]]:
    monkeypatch.setenv("BDL_SHARD_BYTES", SHARD_BYTES)
    monkeypatch.setenv("BDL_SNAPSHOT_EVERY", "100000")
    srv = EmbeddedRedis(tmp_path / "redis").start()
    try:
        yield srv, tmp_path
    finally:
        srv.kill()


def _restart(srv: EmbeddedRedis) -> JobStore:
    srv.kill()
    srv.restart()
    return JobStore(connect(srv.url, wait_s=10), "lj")


@pytest.mark.parametrize("commits", ["4", "2"])  # shard by shard; 2 shards per commit
def test_interleaved_merges_cut_short_by_a_crash_recover_bitwise(env, monkeypatch, commits: str) -> None:
    """Merge A commits 2 of 4 shards and dies; merge B then commits all 4 (after A on A's
    shards, before A on the others); Redis is SIGKILLed before A's other shards are ever
    committed. The rebuilt weights are each shard's merges in its own version order, bit
    for bit; A's re-delivery then applies A's 2 missing shards, once, after B."""
    monkeypatch.setenv("BDL_COMMITS_PER_MERGE", commits)
    srv, tmp = env
    store = new_job(srv.url, tmp / "job", units=3)
    seed_of = {"u0": 10, "u1": 11, "u2": 12}
    assert merge_file(store, result_file(tmp / "r", "lj", "u0", 10), "u0") == "merged"
    a = result_file(tmp / "a", "lj", "u1", 11)
    dying = JobStore(connect(srv.url), "lj", on_shard_applied=_dies_after(2))
    with pytest.raises(KeyboardInterrupt):
        merge_file(dying, a, "u1")
    b_store = JobStore(connect(srv.url), "lj")
    assert merge_file(b_store, result_file(tmp / "b", "lj", "u2", 12), "u2") == "merged"
    orders = _shard_orders(store, seed_of)
    assert sorted(len(o) for o in orders.values()) == [2, 2, 3, 3]  # A reached 2 shards
    assert all(o[0] == 10 for o in orders.values())
    expected = _expected_per_shard(orders)
    assert store.snapshot("0").flat.tobytes() == expected
    after = _restart(srv)
    assert after.snapshot("0").flat.tobytes() == expected
    assert after.snapshot("0").shard_versions == [len(orders[i]) for i in range(4)]
    # The job system delivers A again: its 2 missing shards land after B's, the 2 it
    # committed before the crash are found marked (the rebuild restored their marks).
    assert merge_file(after, a, "u1") == "merged"
    final = _shard_orders(after, seed_of)
    assert all(sorted(o) == [10, 11, 12] for o in final.values())
    assert {tuple(o[1:]) for o in final.values()} == {(11, 12), (12, 11)}
    expected = _expected_per_shard(final)
    assert after.snapshot("0").flat.tobytes() == expected
    assert _restart(srv).snapshot("0").flat.tobytes() == expected


def test_a_replay_never_applies_an_entry_twice(env) -> None:
    """Rebuilds one after another (a restart during the rebuilt state, an AOF rewrite of
    rebuilt bytes, a restart again) start each from a base whose version they know, so
    no record is replayed onto bytes that already hold it; a retried merge finds the
    shards the records list for it; a late call for a finalized unit writes nothing."""
    srv, tmp = env
    store = new_job(srv.url, tmp / "job", units=5)
    for i in range(3):
        assert merge_file(store, result_file(tmp / "r", "lj", f"u{i}", i), f"u{i}") == "merged"
    cut = JobStore(connect(srv.url), "lj", on_shard_applied=_dies_after(1))
    path = result_file(tmp / "r", "lj", "u3", 3)
    with pytest.raises(KeyboardInterrupt):
        merge_file(cut, path, "u3")
    before = store.snapshot("0")
    for _ in range(2):
        again = _restart(srv)
        report = ensure_live(again, "0")
        assert report is not None and report.merges == 4  # u0..u2 and u3's one shard, once each
        assert again.snapshot("0").flat.tobytes() == before.flat.tobytes()
        assert ensure_live(again, "0") is None  # live now: nothing replayed again
    again.r.bgrewriteaof()
    while again.r.info("persistence")["aof_rewrite_in_progress"]:
        pass
    after_rewrite = _restart(srv)
    report = ensure_live(after_rewrite, "0")
    assert report is not None and report.merges == 0  # the rewrite's copy is the rebuilt state
    assert after_rewrite.snapshot("0").flat.tobytes() == before.flat.tobytes()
    # The retry of u3 skips the shard it committed before the crashes.
    assert merge_file(after_rewrite, path, "u3") == "merged"
    records, _ = parse_records(after_rewrite.r.hgetall(after_rewrite.mrec_key("0")))
    assert all(Counter(records[i].values())["u3"] == 1 for i in range(4))
    expected = np.linspace(-1, 1, N, dtype=np.float32)
    for s in range(4):
        merge_into(expected, np.random.default_rng(s).standard_normal(N).astype(np.float32), ALPHA)
    assert after_rewrite.snapshot("0").flat.tobytes() == expected.tobytes()
    # A late call for u3 (finalized) whose marks a restart took: the commit script finds
    # the unit assimilated and writes nothing.
    late = _restart(srv)
    late.snapshot("0")
    mkeys = [late._shard_keys("0", i)[1] for i in range(4)]
    for k in mkeys:
        late.r.hdel(k, "u:u3")
    replies = late._commit_logged(_held(late), "0", "u3", "u:u3",
                                  [(0, late.r.hget(mkeys[0], "tag"), b"x" * 24, memoryview(b"\0" * 2000))])
    assert replies == [(0, 0, None)]
    assert late.snapshot("0").flat.tobytes() == expected.tobytes()


def _held(store: JobStore) -> _Held:
    return _Held(store.r)


def test_no_shard_is_committed_before_its_input_is_on_disk(env, monkeypatch) -> None:
    """A commit logs a record that names the input: the input's fdatasync (slowed down
    here) has returned before the first shard is committed, not only before the merge
    is acknowledged."""
    srv, tmp = env
    new_job(srv.url, tmp / "job", units=1)
    synced: list[str] = []
    real = retained.os.fdatasync

    def slow_sync(fd: int) -> None:
        import time

        time.sleep(0.3)
        real(fd)
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
    monkeypatch.setattr(retained.os, "fdatasync", slow_sync)
    seen: list[int] = []

    def at_commit(n: int) -> None:
        seen.append(len([p for p in synced if "/durable/inputs/" in p]))
    committing = JobStore(connect(srv.url), "lj", on_shard_applied=at_commit)
    assert merge_file(committing, result_file(tmp / "r", "lj", "u0", 0), "u0") == "merged"
    assert seen and all(n >= 1 for n in seen), seen


def test_an_intent_whose_input_never_reached_the_disk_is_taken_over(env) -> None:
    """A machine crash took the first result's retained input before any shard was
    committed (commits wait for its sync): the next result of the unit takes the intent
    over and merges; with a shard committed, the merge waits for the file instead."""
    srv, tmp = env
    store = new_job(srv.url, tmp / "job", units=2)
    # u0: its intent logged, its input gone, nothing committed.
    dying = JobStore(connect(srv.url), "lj", on_merge_step=_raise_at("intent"))
    with pytest.raises(KeyboardInterrupt):
        merge_file(dying, result_file(tmp / "a", "lj", "u0", 1), "u0")
    finish_retained(tmp)
    for f in (tmp / "job" / "durable" / "inputs" / "0").iterdir():
        f.unlink()
    assert merge_file(store, result_file(tmp / "b", "lj", "u0", 2), "u0") == "merged"
    assert "helped" not in store.assimilated()["u0"]
    expected = np.linspace(-1, 1, N, dtype=np.float32)
    merge_into(expected, np.random.default_rng(2).standard_normal(N).astype(np.float32), ALPHA)
    assert _restart(srv).snapshot("0").flat.tobytes() == expected.tobytes()
    # u1: one shard committed from an input that is then lost: not taken over.
    store = JobStore(connect(srv.url), "lj")
    cut = JobStore(connect(srv.url), "lj", on_shard_applied=_dies_after(1))
    with pytest.raises(KeyboardInterrupt):
        merge_file(cut, result_file(tmp / "c", "lj", "u1", 3), "u1")
    finish_retained(tmp)
    entry = store.r.hget(store.mlog_key("0"), "u1")
    first = next(f for f in (tmp / "job" / "durable" / "inputs" / "0").iterdir() if f.name.startswith("u1."))
    first.rename(tmp / "aside.h5")
    with pytest.raises(StoreUnavailable, match="missing"):  # transient: the job system keeps the result
        merge_file(store, result_file(tmp / "d", "lj", "u1", 4), "u1")
    assert store.r.hget(store.mlog_key("0"), "u1") == entry
    (tmp / "aside.h5").rename(first)
    assert merge_file(store, result_file(tmp / "e", "lj", "u1", 5), "u1") == "merged"
    merge_into(expected, np.random.default_rng(3).standard_normal(N).astype(np.float32), ALPHA)
    assert store.snapshot("0").flat.tobytes() == expected.tobytes()


def _raise_at(step: str) -> Callable[[str], None]:
    def hook(name: str) -> None:
        if name == step:
            raise KeyboardInterrupt
    return hook


def test_a_log_of_per_shard_marks_is_still_read(env, monkeypatch) -> None:
    """Merges logged the way the first cut of the log did on one Redis (each shard's
    version and the unit's mark logged in the shard's hash: what a cluster still does),
    then merges logged by commit records: a restarted Redis rebuilds from both, bit for
    bit, and a merge cut short in the old format finds its shards marked."""
    srv, tmp = env
    store = new_job(srv.url, tmp / "job", units=5)
    old = JobStore(connect(srv.url), "lj")
    monkeypatch.setattr(old, "cluster", True)  # per-shard COMMIT_LOGGED, as a cluster commits
    monkeypatch.setattr(old, "_client_for", lambda key: old.r)
    for i in range(2):
        assert merge_file(old, result_file(tmp / "r", "lj", f"u{i}", i), f"u{i}") == "merged"
    assert store.r.hget(store._shard_keys("0", 0)[1], "v") == b"2"  # logged per shard
    assert not any(k[:1].isdigit() for k in store.r.hkeys(store.mrec_key("0")))  # no commit record
    cut = JobStore(connect(srv.url), "lj", on_shard_applied=_dies_after(1))
    monkeypatch.setattr(cut, "cluster", True)
    monkeypatch.setattr(cut, "_client_for", lambda key: cut.r)
    path = result_file(tmp / "r", "lj", "u2", 2)
    with pytest.raises(KeyboardInterrupt):
        merge_file(cut, path, "u2")
    new = _restart(srv)
    assert merge_file(new, path, "u2") == "merged"  # the shard u2 committed is skipped
    assert merge_file(new, result_file(tmp / "r", "lj", "u3", 3), "u3") == "merged"
    expected = np.linspace(-1, 1, N, dtype=np.float32)
    for s in range(4):
        merge_into(expected, np.random.default_rng(s).standard_normal(N).astype(np.float32), ALPHA)
    assert new.snapshot("0").flat.tobytes() == expected.tobytes()
    again = _restart(srv)
    report = ensure_live(again, "0")
    assert report is not None and report.merges == 4
    assert again.snapshot("0").flat.tobytes() == expected.tobytes()


def test_a_crash_between_the_two_pipelined_commits_of_a_lone_merge_recovers_bitwise(env) -> None:
    """A lone assimilator sends its shards in two pipelined calls; it dies after sending
    the first and before sending the second, then Redis is SIGKILLed. The rebuild holds
    the first half's merge and not the second's, bit for bit; the re-delivery applies
    the second half once, and a second restart rebuilds the same bytes."""
    srv, tmp = env
    store = new_job(srv.url, tmp / "job", units=3)
    seed_of = {"u0": 10, "u1": 11}
    assert merge_file(store, result_file(tmp / "r", "lj", "u0", 10), "u0") == "merged"
    real = store._commit_cmds
    parts: list[list[int]] = []

    def second_dies(model, unit, field, items):
        parts.append([i for i, *_ in items])
        if len(parts) == 2:
            raise KeyboardInterrupt  # the process dies between the two calls
        return real(model, unit, field, items)
    store._commit_cmds = second_dies  # type: ignore[method-assign]
    a = result_file(tmp / "a", "lj", "u1", 11)
    with pytest.raises(KeyboardInterrupt):
        merge_file(store, a, "u1")
    assert [len(p) for p in parts] == [2, 2]  # the fast path, in two parts
    deadline = time.monotonic() + 10
    while not any(k.endswith(b":u1") and not k.startswith(b"s:") for k in store.r.hkeys(store.mrec_key("0"))):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    orders = _shard_orders(store, seed_of)
    assert {i for i, o in orders.items() if o == [10, 11]} == set(parts[0])
    expected = _expected_per_shard(orders)
    after = _restart(srv)
    assert after.snapshot("0").flat.tobytes() == expected
    assert merge_file(after, a, "u1") == "merged"
    final = _shard_orders(after, seed_of)
    assert all(o == [10, 11] for o in final.values())
    expected = _expected_per_shard(final)
    assert after.snapshot("0").flat.tobytes() == expected
    assert _restart(srv).snapshot("0").flat.tobytes() == expected


def test_a_lone_merge_whose_scripts_redis_lost_loads_them_and_commits_both_parts_once(env) -> None:
    """Redis forgets its scripts between two merges (SCRIPT FLUSH; a restart does the
    same): both pipelined parts of the next lone merge fail with NOSCRIPT. Their replies
    are read in order, the script is loaded, both parts commit once, and the connection
    is left in step (the next merge reads its own replies)."""
    srv, tmp = env
    store = new_job(srv.url, tmp / "job", units=4)
    seed_of = {"u0": 10, "u1": 11, "u2": 12}
    assert merge_file(store, result_file(tmp / "r0", "lj", "u0", 10), "u0") == "merged"
    assert merge_file(store, result_file(tmp / "r1", "lj", "u1", 11), "u1") == "merged"  # the fast path warm
    store.r.script_flush()
    assert merge_file(store, result_file(tmp / "r2", "lj", "u2", 12), "u2") == "merged"
    orders = _shard_orders(store, seed_of)
    assert all(o == [10, 11, 12] for o in orders.values()), orders
    raw = [k for k in store.r.hkeys(store.mrec_key("0")) if k.endswith(b":u2") and not k.startswith(b"s:")]
    assert len(raw) == 2  # two parts, each committed once
    expected = _expected_per_shard(orders)
    assert store.snapshot("0").flat.tobytes() == expected
    assert _restart(srv).snapshot("0").flat.tobytes() == expected
