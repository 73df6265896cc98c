"""``boinc-dl boinc restart``: ``bin/stop``, wait until the daemons are gone, ``bin/start``.

BOINC's ``bin/stop`` (``sched/start``, ``stop_daemons()``) sends SIGHUP to every pid in
``pid_<host>/*.pid`` and returns without waiting: under Python 3 its wait loop iterates
a ``map`` object that the kill loop already consumed. ``bin/start`` then skips, silently,
every daemon whose lock (``pid_<host>/<output>.lock``, held by the running daemon) is
still taken. A ``script_assimilator`` or ``script_validator`` stops only after the
script it is running returns, so a plain ``bin/stop; bin/start`` can leave it stopped.
This command waits for the old processes, starts the daemons, and checks that each of
boinc-dl's daemons holds its lock again.
"""

from __future__ import annotations

import os
import subprocess
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from boinc_dl.server.backends.boinc.install import is_our_daemon
from boinc_dl.server.backends.boinc.project import BoincProject
from boinc_dl.server.backends.boinc.xmlmerge import child_text
from boinc_dl.server.common.procs import pid_alive


@dataclass
class RestartReport:
    """What the restart saw: daemons running again, and those that are not."""

    running: list[str] = field(default_factory=list)
    not_running: list[str] = field(default_factory=list)
    stragglers: list[int] = field(default_factory=list)


def _pids(project: BoincProject) -> list[int]:
    out = []
    for p in sorted(project.pid_dir.glob("*.pid")):
        try:
            out.append(int(p.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            continue
    return out


def lock_held(path: Path) -> bool:
    """Whether a process holds a lock on ``bin/start``'s lock file. Read from
    ``/proc/locks`` rather than by trying the lock: a test lock taken while ``bin/start``
    is starting the daemon would make it skip the daemon."""
    try:
        st = path.stat()
        locks = Path("/proc/locks").read_text()
    except OSError:
        return False
    for line in locks.splitlines():
        parts = line.split()
        # "1: POSIX  ADVISORY  WRITE 1234 fd:01:5678 0 EOF" (a "->" marks a waiter)
        if "->" in parts:
            continue
        for field_ in parts:
            bits = field_.split(":")
            if len(bits) == 3 and bits[2].isdigit() and int(bits[2]) == st.st_ino:
                try:
                    if os.makedev(int(bits[0], 16), int(bits[1], 16)) == st.st_dev:
                        return True
                except ValueError:
                    continue
    return False


def our_daemons(project: BoincProject) -> list[tuple[str, Path]]:
    """(command, lock file) of boinc-dl's enabled daemons in config.xml."""
    # Not host data: the project's own config.xml (admin-written); expat fetches no
    # external entities and refuses entity-expansion bombs (>= 2.4.1).
    root = ET.parse(project.config_xml).getroot()  # nosec B314
    out = []
    for el in root.findall("daemons/daemon"):
        if not is_our_daemon(el) or child_text(el, "disabled") not in ("", "0"):
            continue
        cmd = child_text(el, "cmd")
        name = child_text(el, "lock_file") or f"{child_text(el, 'output') or Path(cmd.split()[0]).name + '.log'}.lock"
        out.append((cmd, project.pid_dir / name))
    return out


def restart(project: BoincProject, wait_s: float = 120.0, start_wait_s: float = 15.0) -> RestartReport:
    """Stop every daemon of the project, wait for them to exit, start them, check ours."""
    rep = RestartReport()
    before = _pids(project)
    subprocess.run(project.tool_command("stop", []), cwd=project.root, check=True, timeout=120)
    deadline = time.monotonic() + wait_s
    while any(pid_alive(p) for p in before) and time.monotonic() < deadline:
        time.sleep(0.2)
    rep.stragglers = [p for p in before if pid_alive(p)]
    subprocess.run(project.tool_command("start", []), cwd=project.root, check=True, timeout=120)
    daemons = our_daemons(project)
    deadline = time.monotonic() + start_wait_s
    while time.monotonic() < deadline and not all(lock_held(lock) for _, lock in daemons):
        time.sleep(0.2)
    for cmd, lock in daemons:
        (rep.running if lock_held(lock) else rep.not_running).append(cmd)
    return rep
