"""Shared helpers of the fake BOINC tools (test doubles, not BOINC code).

Each fake records its argv, stdin and working directory as one JSON line in
``<project>/fake_calls.jsonl`` and keeps a tiny JSON "database" in
``<project>/fake_boinc_db.json`` (apps, app versions, workunits).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent  # the fakes live in <project>/bin/


def record(tool: str, stdin: str | None = None) -> None:
    entry = {"tool": tool, "argv": sys.argv[1:], "cwd": os.getcwd(), "stdin": stdin, "t": time.time()}
    with open(PROJECT / "fake_calls.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def die(msg: str, code: int = 1) -> None:
    sys.stderr.write(msg.rstrip("\n") + "\n")
    sys.exit(code)


@contextmanager
def database():
    """The fake database, locked and written back on exit."""
    path = PROJECT / "fake_boinc_db.json"
    with open(PROJECT / ".fake_boinc_db.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        db = json.loads(path.read_text()) if path.exists() else {}
        db.setdefault("apps", [])
        db.setdefault("app_versions", [])
        db.setdefault("workunits", {})
        db.setdefault("next_wu_id", 1)
        yield db
        path.write_text(json.dumps(db, indent=1))


def config_value(tag: str) -> str | None:
    import xml.etree.ElementTree as ET

    cfg = ET.parse(PROJECT / "config.xml").getroot().find("config")
    el = cfg.find(tag) if cfg is not None else None
    return None if el is None else (el.text or "").strip()


def hier_path(name: str, root: str, fanout: int) -> Path:
    """dir_hier_path as described in BOINC's docs: md5(name)[1:8] mod fanout, in hex."""
    if fanout == 0:
        return Path(root) / name
    x = int(hashlib.md5(name.encode()).hexdigest()[1:8], 16) % fanout
    return Path(root) / f"{x:x}" / name


def is_project_dir(d: str) -> bool:
    return os.path.isfile(os.path.join(d, "config.xml")) and os.path.isdir(os.path.join(d, "cgi-bin"))
