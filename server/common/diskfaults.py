"""Server-side I/O faults: a full disk, an I/O error or a read-only file system is the
server's fault, never a host's.

Such a fault must not be charged to a unit (counted as a client error, a rejected
result, a give-up): the job pauses with one line naming the path and the space it
needs, and continues with ``--resume`` (or the BOINC daemon's next pass) once the
admin has freed space. :func:`server_fault` recognises one from an exception (an
``OSError`` of :data:`SERVER_ERRNOS`, or Redis refusing writes because its
append-only file cannot be written); :class:`ServerResourceError` is the error that
says so, with the exit code :data:`EXIT_SERVER_FAULT`.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from boinc_dl.server.common.errors import BoincDLError

#: The errors of a server's storage, not of its input: full disk or quota, I/O error,
#: read-only file system.
SERVER_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})
#: ``boinc-dl run``'s exit status when a server-side I/O fault paused the job
#: (EX_TEMPFAIL of sysexits.h: try again later).
EXIT_SERVER_FAULT = 75


#: What a paused run asks to be freed beyond its files' growth: Redis's append-only
#: file, logs, a few weights versions.
RUN_HEADROOM_BYTES = 64 << 20
RESUME_ADVICE = "free space (or fix the disk), then continue with --resume"


def run_space_needed(n_params: int, slots: int) -> int:
    """Bytes a run needs free to go on: per slot an upload and a checkpoint (weights and
    optimizer state: 4 model copies), 8 model copies for weights versions and Redis's
    append-only file, and :data:`RUN_HEADROOM_BYTES`."""
    return (4 * slots + 8) * 4 * max(0, n_params) + RUN_HEADROOM_BYTES


def human(n: float) -> str:
    """Bytes in a short human form (``12.3 MB``)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def free_bytes(path: str | Path) -> int | None:
    """Bytes free to an unprivileged writer on the file system holding ``path`` (or its
    nearest existing parent); None if it cannot be told."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


class ServerResourceError(BoincDLError):
    """The server cannot write (or read) its own files: the job pauses, no unit is charged."""

    exit_code = EXIT_SERVER_FAULT

    def __init__(self, path: str | Path, what: str, needed: int | None = None, code: int | None = None,
                 then: str = ""):
        self.path, self.what, self.needed, self.code, self.then = str(path), what, needed, code, then
        super().__init__(self._line())

    def _line(self) -> str:
        free = free_bytes(self.path) if self.code in (errno.ENOSPC, errno.EDQUOT, None) else None
        room = ""
        if free is not None:
            room = f"; {human(free)} free there"
            if self.needed:
                room += f", at least {human(self.needed)} needed"
        then = f"; {self.then}" if self.then else ""
        return f"server-side I/O fault (no unit was charged): {self.what} at {self.path}{room}{then}"

    def with_advice(self, then: str, needed: int | None = None) -> ServerResourceError:
        """The same fault, saying what to do next (and the space needed, if known)."""
        return ServerResourceError(self.path, self.what, needed or self.needed, self.code, then)


def server_fault(e: BaseException) -> tuple[str, int | None] | None:
    """``(what, errno)`` if ``e`` is a server-side I/O fault, else None: an ``OSError``
    of :data:`SERVER_ERRNOS`, an error whose text carries one (HDF5 reports the C
    library's errno in its message), or Redis refusing writes it cannot persist."""
    if isinstance(e, OSError) and e.errno in SERVER_ERRNOS:
        return os.strerror(e.errno), e.errno
    text = str(e)
    if "MISCONF" in text or "writing to the AOF" in text:
        return "Redis cannot write its append-only file (" + text.splitlines()[0][:160] + ")", None
    for code in sorted(SERVER_ERRNOS):
        if os.strerror(code) in text:
            return os.strerror(code), code
    return None


_HDF5_FILENAME = re.compile(r"filename = '([^']+)'")


#: A path, or how to find it (called only when an error names no file of its own).
DefaultPath = str | Path | Callable[[], str | Path]


def fault_path(e: BaseException, default: DefaultPath) -> str:
    """The file an error names (the destination of a copy; the file in an HDF5 message),
    else ``default`` (called, if it is a function)."""
    name = getattr(e, "filename2", None) or getattr(e, "filename", None)
    if not name:
        m = _HDF5_FILENAME.search(str(e))
        name = m.group(1) if m else None
    if name:
        return str(name)
    return str(default() if callable(default) else default)


def as_server_error(e: BaseException, default_path: DefaultPath, needed: int | None = None,
                    then: str = "") -> ServerResourceError | None:
    """The :class:`ServerResourceError` for ``e`` if it is a server-side I/O fault, else None.
    ``default_path`` names where the fault is when ``e`` names no file (a function: asked
    only then, e.g. Redis for its directory)."""
    if isinstance(e, ServerResourceError):
        return e
    fault = server_fault(e)
    if fault is None:
        return None
    what, code = fault
    return ServerResourceError(fault_path(e, default_path), what, needed, code, then)
