"""BOINC slot-directory I/O: logical file names, ``init_data.xml``, progress files.

A BOINC client starts the app in a *slot* directory. Each input and output file of
the task appears there under its logical name, either as a copy of the file or as a
small *link file* whose whole content is ``<soft_link>PATH</soft_link>``; PATH
(usually ``../../projects/<project>/<physical name>``) is relative to the slot
directory. Outputs are link files too, pointing at the upload location, so an
output must be written *through* the resolved path, never over the link file.

Outside BOINC (the local backend, tests) the files sit in the directory directly
and everything here degrades to plain paths. Nothing here imports TensorFlow.
"""

from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INIT_DATA = "init_data.xml"
FRACTION_DONE = "fraction_done"
#: Where a BOINC Docker app's container sees the project directory (job.toml's
#: ``project_dir_mount``); set by the container's entry point.
PROJECT_MOUNT_ENV = "BDL_PROJECT_MOUNT"

# Link files are tiny; anything bigger is a real file even if it starts oddly.
_LINK_MAX_BYTES = 4096
_SOFT_LINK = re.compile(rb"^\s*<soft_link>\s*(.*?)\s*</soft_link>\s*$", re.S)


def read_link(path: str | Path) -> str | None:
    """The target written in a BOINC link file, or None if ``path`` is not one."""
    p = Path(path)
    try:
        if not p.is_file() or p.stat().st_size > _LINK_MAX_BYTES:
            return None
        m = _SOFT_LINK.match(p.read_bytes())
    except OSError:
        return None
    if not m or not m.group(1):
        return None
    return m.group(1).decode("utf-8", errors="surrogateescape")


def resolve(slot_dir: str | Path, logical: str, project_mount: str | Path | None = None) -> Path:
    """Resolve a logical file name in a slot directory (BOINC's ``boinc_resolve_filename``).

    Follows one level of link file, relative to the slot directory (an absolute
    target is used as is); otherwise returns ``slot_dir/logical``, existing or not.

    In a BOINC Docker app's container the project directory is not where the link
    points (``../../projects/<project>/`` from the slot) but where docker_wrapper
    mounted it: ``project_mount``, by default ``$BDL_PROJECT_MOUNT`` (set by the
    container's entry point). A target under a ``projects/<project>/`` directory is
    then read from there; one that leaves that directory is refused.
    """
    slot = Path(slot_dir)
    path = slot / logical
    target = read_link(path)
    if target is None:
        return path
    mount = project_mount if project_mount is not None else os.environ.get(PROJECT_MOUNT_ENV, "")
    if mount:
        return _in_project_mount(Path(mount), target, path)
    return Path(os.path.normpath(slot / target))


def _in_project_mount(mount: Path, target: str, link: Path) -> Path:
    parts = target.replace("\\", "/").split("/")
    for i in range(len(parts) - 2):
        if parts[i] == "projects" and parts[i + 1] not in ("", ".", ".."):
            rest = [p for p in parts[i + 2:] if p not in ("", ".")]
            if rest and ".." not in rest:
                return mount.joinpath(*rest)
            break
    raise ValueError(f"{link}: link target {target!r} is not a file of the project directory")


@dataclass(frozen=True)
class InitData:
    """The parts of BOINC's ``init_data.xml`` the app uses."""

    result_name: str = ""
    wu_name: str = ""
    gpu_type: str = ""
    gpu_device_num: int = -1
    ncpus: float = 0.0
    checkpoint_period: float = 0.0
    project_dir: str = ""

    @property
    def uses_gpu(self) -> bool:
        """True when the client scheduled this task on a GPU."""
        return bool(self.gpu_type) and self.gpu_device_num >= 0


_FIELDS: dict[str, type] = {
    "result_name": str,
    "wu_name": str,
    "gpu_type": str,
    "gpu_device_num": int,
    "ncpus": float,
    "checkpoint_period": float,
    "project_dir": str,
}


def read_init_data(slot_dir: str | Path) -> InitData | None:
    """Parse ``init_data.xml`` in the slot directory; None if there is none.

    The client writes a large document (host info, preferences); only top-level
    fields are read. A file that is not well-formed XML is scanned for the same
    tags, so a stray character elsewhere in it does not lose the result name.
    """
    path = Path(slot_dir) / INIT_DATA
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    raw: dict[str, str] = {}
    try:
        # Not host data: init_data.xml written by the local BOINC client for this task; expat
        # fetches no external entities and refuses entity-expansion bombs (>= 2.4.1)
        root = ET.fromstring(text)  # nosec B314
        for name in _FIELDS:
            el = root.find(name)
            if el is not None and el.text is not None:
                raw[name] = el.text.strip()
    except ET.ParseError:
        for name in _FIELDS:
            m = re.search(rf"<{name}>([^<]*)</{name}>", text)
            if m:
                raw[name] = m.group(1).strip()
    values: dict[str, Any] = {}
    for name, typ in _FIELDS.items():
        if name not in raw:
            continue
        try:
            values[name] = typ(float(raw[name])) if typ is int else typ(raw[name])
        except ValueError:
            continue  # keep the default for an unparsable number
    return InitData(**values)


def atomic_write_bytes(path: str | Path, data: bytes, *, fsync: bool = False) -> None:
    """Write a file so that readers see the old or the new content, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: str | Path, obj: Any, *, fsync: bool = False) -> None:
    """Atomically write ``obj`` as JSON."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode(), fsync=fsync)


def write_fraction_done(slot_dir: str | Path, fraction: float) -> None:
    """Write the fraction done (0..1) where BOINC's wrapper reads it.

    The wrapper parses the last line of the file, so the file holds one number;
    it is replaced atomically so that a read never sees a half-written line.
    """
    f = min(1.0, max(0.0, float(fraction)))
    atomic_write_bytes(Path(slot_dir) / FRACTION_DONE, f"{f:.6f}\n".encode())
