"""Names from outside that become paths, and writes confined under a base directory.

Every string a host (or a result file) could influence is checked with
:func:`check_name` before it is joined to a path, and every path built under a base
directory for a result or a unit goes through :func:`confined`, which resolves it and
refuses anything that lands outside the base (``..``, absolute parts, symlinks).
"""

from __future__ import annotations

import re
from pathlib import Path

from boinc_dl.server.common.errors import ResultRejected

# The job-name rule (spec.JOB_NAME_RE), long enough for unit and result names, which
# are built from a job name plus model/epoch/shard/attempt/replica suffixes.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$")


def is_safe_name(name: object) -> bool:
    """True for a string usable as one path component (letters, digits, ``_.-``)."""
    return isinstance(name, str) and bool(NAME_RE.match(name)) and ".." not in name


def check_name(name: object, what: str = "name") -> str:
    """``name`` unchanged if :func:`is_safe_name`, else :class:`ResultRejected`."""
    if not is_safe_name(name):
        raise ResultRejected(f"{what} {str(name)[:80]!r} is not a safe name (letters, digits, '_', '.', '-')")
    return str(name)


def confined(base: str | Path, *parts: str) -> Path:
    """``base/parts...`` resolved, guaranteed to lie under ``base`` (resolved).

    Each part must be a safe name (:func:`check_name`); the resolved result must still
    be inside the base even when a symlink sits on the way.
    """
    root = Path(base).resolve()
    for p in parts:
        check_name(p, "path component")
    target = root.joinpath(*parts).resolve()
    if target != root and root not in target.parents:
        raise ResultRejected(f"path {target} escapes {root}")
    return target
