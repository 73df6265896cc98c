"""Retained inputs: a merged result's weights file, kept until a snapshot covers its merge.

A durable merge logs its input by name (``docs/parameter-server.md``, "Durability"):
the bytes a replay needs are the result's weights file, already on the server's disk.
Job systems delete result files once a merge is acknowledged (BOINC's file deleter,
the local backend's cleanup, BOINC's intake removes its working copy), so the file is
first given a second name in the job's retained area, ``<durable dir>/inputs/<model>/``:

* **one filesystem**: a hard link, which costs no copy; deleting the upload later
  removes one name, the data stays until the retained name goes too;
* **another filesystem** (``EXDEV``): a copy, bounded by the job's upload bound (about
  10-20 ms for 20 MB); ``RetainedInput.copied`` says which happened.

A background thread then ``fdatasync`` calls on the file and its directory, overlapping the
validation and the merge; the merge waits for that before it is acknowledged
(:meth:`RetainedInput.wait_synced`), so an acknowledged merge never names an input that
a crash of the machine could take back. Once the merge is acknowledged (or has
failed) the same thread computes the file's SHA-256, so that the hash does not compete
with the merge for the CPU, and hands it to the merge's ``then_record`` callback (which
records it in the merge's log); a process that exits first hashes what it retained
and waits for its threads (``atexit``). The retained file is removed when a snapshot covers
its merge (:mod:`boinc_dl.server.assimilator.snapshot`).
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

from boinc_dl.server.common import bounded
from boinc_dl.server.common.errors import ResultRejected
from boinc_dl.server.common.paths import confined


class RetainedInput:
    """One result file, retained under ``area``: its path, size and (once computed) SHA-256."""

    def __init__(self, source: Path, path: Path, rel: str, size: int, copied: bool):
        self.source = source
        self.path = path
        #: The path relative to the durable dir: what the log records.
        self.rel = rel
        self.size = size
        self.copied = copied
        self._sha: str | None = None
        self._error: BaseException | None = None
        self._synced = threading.Event()
        self._hashed = threading.Event()
        self._handed = threading.Event()
        # Set when the hash may start: the merge is acknowledged (``then_record``), or
        # someone waits for the hash (``sha256``), or the process exits.
        self._go = threading.Event()
        self._discarded = False
        self._then: Callable[[str], None] | None = None
        self._thread = threading.Thread(target=self._settle, name="bdl-retain", daemon=True)
        _pending.add(self._thread)
        _inputs.add(self)
        self._thread.start()

    def _settle(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
            sync_dir(self.path.parent)
        except BaseException as e:  # noqa: BLE001 - reported by wait_synced()
            self._error = e
        self._synced.set()
        self._go.wait(300)
        if self._error is None and not self._discarded:
            try:
                self._sha = sha256_of(self.path)
            except OSError as e:  # removed meanwhile (discarded): nothing to record
                self._error = e
        self._hashed.set()
        if self._sha is not None and self._handed.wait(300) and self._then is not None:
            try:
                self._then(self._sha)
            except Exception:  # noqa: BLE001 - the entry then keeps its size check only
                pass

    def wait_synced(self) -> None:
        """Block until the file and its name are on disk (OSError if that failed)."""
        self._synced.wait()
        if self._error is not None:
            raise OSError(f"retained input {self.path}: {self._error}") from self._error

    def sha_if_ready(self) -> str | None:
        """The SHA-256 if the thread has computed it already, else None (no waiting)."""
        return self._sha if self._hashed.is_set() else None

    def sha256(self) -> str:
        """Block until the file is hashed; its SHA-256 (hex)."""
        self.wait_synced()
        self._go.set()
        self._hashed.wait()
        if self._sha is None:
            raise OSError(f"retained input {self.path}: {self._error}")
        return self._sha

    def then_record(self, fn: Callable[[str], None] | None) -> None:
        """Hash the file now, then call ``fn(sha256)`` from the thread (None: nothing to
        record). Nothing is recorded for a discarded file."""
        if not self._discarded:
            self._then = fn
        self._handed.set()
        self._go.set()

    def release(self) -> None:
        """Let the thread hash the file and finish now, recording the SHA-256 only if
        :meth:`then_record` was called (the merge that retained it is over)."""
        self._handed.set()
        self._go.set()

    def discard(self) -> None:
        """Remove the retained name (its merge was not logged: rejected, a duplicate)."""
        self._discarded = True
        self.then_record(None)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def retain(source: Path, durable_dir: Path, model: str, unit: str, max_bytes: int | None = None) -> RetainedInput:
    """Give ``source`` a second name in the retained area of ``model`` (hard link, or a
    bounded copy across filesystems) and start hashing and syncing it.

    ``unit`` and ``model`` come from the job's records, never from the file; the name
    is built with :func:`confined`. Raises :class:`ResultRejected` for a symbolic link
    or a file over ``max_bytes``, ``OSError`` when the area cannot be written."""
    source = Path(source)
    if source.is_symlink():
        raise ResultRejected(f"result file {source.name} is a symbolic link")
    area = confined(durable_dir, "inputs", model)
    area.mkdir(parents=True, exist_ok=True)
    size = source.stat().st_size
    if max_bytes is not None and size > max_bytes:
        raise ResultRejected(f"result file {source.name}: {size} bytes, over the {max_bytes}-byte bound")
    name = f"{unit}.{os.urandom(6).hex()}.h5"
    path = confined(area, name)
    copied = False
    try:
        os.link(source, path)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        # Another filesystem (or one without hard links): a copy of its own.
        bounded.copy_file_bounded(source, path, max_bytes if max_bytes is not None else size)
        copied = True
    return RetainedInput(source, path, f"inputs/{model}/{name}", size, copied)


# Threads still hashing: a short-lived process (BOINC's script) finishes them at exit,
# so that its merges' log entries get their SHA-256.
_pending: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_inputs: weakref.WeakSet[RetainedInput] = weakref.WeakSet()


@atexit.register
def _finish_pending() -> None:
    for inp in list(_inputs):
        inp._go.set()  # a merge that never got to its end: hash what it retained all the same
        inp._handed.set()  # (with nothing to record it for, if the merge never said)
    for t in list(_pending):
        t.join(60)


def sha256_of(path: Path) -> str:
    """SHA-256 (hex) of a file, hashed from a read-only mapping of it (no copy through
    a buffer; hashlib releases the GIL while it hashes)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
                h.update(m)
    return h.hexdigest()


def sync_dir(path: Path) -> None:
    """fsync a directory, so that a name just created in it survives a machine crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
