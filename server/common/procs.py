"""Process liveness on this host (daemons restarted by ``boinc-dl boinc restart``, the
owner of a run shown by ``boinc-dl status``)."""

from __future__ import annotations

import os


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
