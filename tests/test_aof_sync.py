"""The AOF syncer: boinc-dl's once-a-second fdatasync of a Redis AOF (appendfsync no)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import redis

from boinc_dl.server.assimilator.aof_sync import AofSyncer, aof_files
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis


def test_finds_both_aof_layouts(tmp_path: Path) -> None:
    assert aof_files(tmp_path) == []
    (tmp_path / "appendonly.aof").write_bytes(b"x")
    parts = tmp_path / "appendonlydir"
    parts.mkdir()
    for name in ("appendonly.aof.1.base.rdb", "appendonly.aof.1.incr.aof", "appendonly.aof.manifest"):
        (parts / name).write_bytes(b"y")
    (parts / "sub").mkdir()  # not a file: skipped
    names = [p.name for p in aof_files(tmp_path)]
    assert names == ["appendonly.aof", "appendonly.aof.1.base.rdb", "appendonly.aof.1.incr.aof",
                     "appendonly.aof.manifest"]


class _Recorded(AofSyncer):
    """An AofSyncer that records which thread made each pass."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.by: list[str] = []

    def sync_once(self) -> int:
        self.by.append(threading.current_thread().name)
        return super().sync_once()


def test_syncs_every_interval_and_once_more_on_stop(tmp_path: Path) -> None:
    (tmp_path / "appendonly.aof").write_bytes(b"x" * 4096)
    syncer = _Recorded(tmp_path, interval_s=0.05).start()
    time.sleep(0.4)
    assert syncer.running and syncer.passes >= 3
    assert set(syncer.by) == {"bdl-aof-sync"}
    syncer.stop()
    assert not syncer.running
    # the last pass on stop: made by the stopping thread, after the syncer's thread ended
    assert syncer.by[-1] == threading.current_thread().name and syncer.by.count(syncer.by[-1]) == 1
    assert syncer.passes == len(syncer.by)
    assert syncer.sync_once() == 1


def test_a_file_removed_by_a_rewrite_is_skipped(tmp_path: Path, monkeypatch) -> None:
    gone = tmp_path / "appendonly.aof"
    monkeypatch.setattr("boinc_dl.server.assimilator.aof_sync.aof_files", lambda d: [gone])  # listed, then removed
    assert AofSyncer(tmp_path).sync_once() == 0


def test_embedded_redis_runs_it_with_appendfsync_no_and_not_otherwise(tmp_path: Path) -> None:
    srv = EmbeddedRedis(tmp_path / "a", sync_interval_s=0.05).start()
    try:
        r = redis.Redis(unix_socket_path=str(srv.socket))
        assert r.config_get("appendfsync")["appendfsync"] == "no"
        r.set("k", os.urandom(1 << 20))
        time.sleep(0.3)
        assert srv.syncer is not None and srv.syncer.running and srv.syncer.passes >= 2
        assert aof_files(srv.data_dir)
        srv.kill()  # a crash stops it; a restart starts it again
        assert not srv.syncer.running
        srv.restart()
        assert srv.syncer.running
    finally:
        srv.stop()
    assert not srv.syncer.running
    always = EmbeddedRedis(tmp_path / "b", appendfsync="always")
    assert always.syncer is None  # Redis fsyncs every write itself
    assert EmbeddedRedis(tmp_path / "c", sync_interval_s=None).syncer is None
