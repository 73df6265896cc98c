"""Exclusive advisory locks on a file: one ``boinc-dl run`` per run directory, one
``boinc-dl submit`` per BOINC job.

The lock is ``fcntl.flock`` on an open file: the kernel drops it when the last
descriptor of that open file is closed, which happens on every way out of the process
(return, exception, SIGTERM, SIGKILL, a crash), so it never goes stale the way a pid
file does. The descriptor is not inherited across ``exec`` (Python opens it
close-on-exec), and boinc-dl's children are exec'd (Redis) or forked from the
multiprocessing fork server (slots, assimilators), so no child can keep a dead run's
lock. The file's text (pid, host, start time, what holds it) is only for the message
the loser prints.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from boinc_dl.server.common.errors import BoincDLError


class LockBusy(BoincDLError):
    """Another process holds the lock."""

    def __init__(self, message: str, holder: dict[str, Any]):
        super().__init__(message)
        self.holder = holder


class FileLock:
    """``with FileLock(path, what):`` holds an exclusive lock on ``path`` (created if
    missing) or raises :class:`LockBusy` at once; never waits."""

    def __init__(self, path: str | Path, what: str = "boinc-dl"):
        self.path = Path(path)
        self.what = what
        self.fd: int | None = None

    def acquire(self) -> FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise LockBusy(f"{self.path.parent} is in use by {describe_holder(holder)}", holder) from None
        except OSError:
            os.close(fd)
            raise
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "what": self.what}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor drops the lock
            self.fd = None

    def __enter__(self) -> FileLock:
        return self.acquire() if self.fd is None else self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "{}")
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def describe_holder(holder: dict[str, Any]) -> str:
    """``another boinc-dl run (pid 123, started 10:02:11)`` from a lock file's text."""
    what = str(holder.get("what") or "another boinc-dl process")
    bits = []
    if holder.get("pid"):
        host = holder.get("host")
        bits.append(f"pid {holder['pid']}" + (f" on {host}" if host and host != socket.gethostname() else ""))
    if isinstance(holder.get("since"), int | float):
        bits.append("started " + time.strftime("%H:%M:%S", time.localtime(holder["since"])))
    return f"another {what}" + (f" ({', '.join(bits)})" if bits else "")
