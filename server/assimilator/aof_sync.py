"""Flush a Redis append-only file to disk from outside Redis, once a second.

Why not Redis's own ``appendfsync everysec``: with that policy, when the previous
second's background fsync is still running, Redis postpones the ``write(2)`` of new
commands to the AOF for up to two seconds and *still replies to the clients*
(``flushAppendOnlyFile`` in ``aof.c`` returns early; ``beforeSleep`` in ``server.c``
then sends the pending replies). A merge acknowledged in that window exists only in
Redis's memory, and a crash of the Redis process loses it. With a model-sized write per
merge the fsync is slow often enough for that to happen (``tests/test_faults_store.py``
reproduces it). So boinc-dl runs Redis with ``appendfsync no`` — every command is
written to the kernel before its reply, always — and this syncer gives back the
bound on an OS crash that ``everysec`` was for: what Redis has written is on disk
within about ``interval_s``. A slow fsync here delays nothing in Redis.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)


def aof_files(data_dir: Path) -> list[Path]:
    """The AOF files Redis writes in ``data_dir``: Redis 7's ``appendonlydir/*`` parts and
    the single ``appendonly.aof`` of earlier versions."""
    files = [data_dir / "appendonly.aof"]
    parts = data_dir / "appendonlydir"
    if parts.is_dir():
        files.extend(sorted(parts.iterdir()))
    return [f for f in files if f.is_file()]


class AofSyncer:
    """A daemon thread that ``fdatasync``s the AOF files of one Redis data dir every
    ``interval_s`` seconds, until :meth:`stop`."""

    def __init__(self, data_dir: str | Path, interval_s: float = 1.0):
        self.data_dir = Path(data_dir)
        self.interval_s = interval_s
        #: Completed passes (every AOF file synced once); tests and diagnostics read it.
        self.passes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sync_once(self) -> int:
        """Sync every AOF file now; returns how many were synced."""
        n = 0
        for path in aof_files(self.data_dir):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # removed by a rewrite since it was listed
                continue
            try:
                os.fdatasync(fd)
                n += 1
            finally:
                os.close(fd)
        self.passes += 1
        return n

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sync_once()
            except OSError as e:  # a full or failing disk: Redis reports it to its clients itself
                log.warning("fdatasync of the AOF in %s failed: %s", self.data_dir, e)

    def start(self) -> AofSyncer:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="bdl-aof-sync", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (after a last pass, so nothing written is left unsynced)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self._thread = None
        try:
            self.sync_once()
        except OSError:
            pass

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
