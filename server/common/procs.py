"""Process liveness on this host (daemons restarted by ``boinc-dl boinc restart``, the
owner of a run shown by ``boinc-dl status``), and the working directories a killed
process leaves behind."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host and has not exited (a zombie has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True


def owned_prefix(name: str) -> str:
    """The name prefix of a working directory this process owns, ``<name>.<pid>.``
    (``tempfile.mkdtemp(prefix=...)`` adds the random part): what
    :func:`sweep_orphaned_dirs` recognises once the process is gone."""
    return f"{name}.{os.getpid()}."


def sweep_orphaned_dirs(parent: Path, prefix: str = "") -> None:
    """Remove the directories ``<name>.<pid>.<random>`` under ``parent`` (starting with
    ``prefix``) whose process is gone: a SIGKILLed process, which could not remove its
    own, leaves it behind no longer than the next call."""
    parent.mkdir(parents=True, exist_ok=True)
    for d in parent.iterdir():
        if not d.name.startswith(prefix):
            continue
        parts = d.name.rsplit(".", 2)
        if len(parts) != 3 or not parts[1].isdigit() or not d.is_dir() or d.is_symlink():
            continue
        try:
            gone = not pid_alive(int(parts[1]))
        except OverflowError:
            continue
        if gone:
            shutil.rmtree(d, ignore_errors=True)

