"""Fake ``bin/start`` / ``bin/stop`` (one program, as in BOINC's ``sched/start``).

What the real script does and this one reproduces (test double, not BOINC code):

* start: removes the ``stop_daemons`` file, then for each ``<daemon>`` of config.xml
  double-forks; the child takes ``pid_<host>/<output>.lock`` with ``lockf`` (an
  inheritable descriptor, so the exec'd daemon holds it) and *skips the daemon
  silently if the lock is held*; it then redirects output to ``log_<host>/<output>``,
  writes ``pid_<host>/<pid_file>`` and execs the command from ``tmp_<host>`` with
  ``bin/`` first on PATH. Daemons whose program is not in ``bin/`` (BOINC's own
  binaries, absent here) are skipped.
* stop: writes ``stop_sched`` (the scheduler then answers "project down" with
  ``maintenance_delay``; start removes it last) and ``stop_daemons``, sends SIGHUP to every pid in ``pid_<host>/*.pid`` and
  returns *without waiting* (under Python 3, ``stop_daemons()`` iterates a ``map``
  object twice, so its wait loop sees nothing) and without removing the pid files.
"""

import fcntl
import os
import shlex
import signal
import socket
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from _fakelib import PROJECT, record

HOST = socket.gethostname().split(".")[0]
PID_DIR = PROJECT / f"pid_{HOST}"
LOG_DIR = PROJECT / f"log_{HOST}"
TMP_DIR = PROJECT / f"tmp_{HOST}"


def daemons():
    root = ET.parse(PROJECT / "config.xml").getroot()
    for d in root.findall("daemons/daemon"):
        if (d.findtext("disabled") or "0").strip() not in ("0", ""):
            continue
        cmd = (d.findtext("cmd") or "").strip()
        base = shlex.split(cmd)[0]
        out = (d.findtext("output") or "").strip() or base + ".log"
        pid = (d.findtext("pid_file") or "").strip() or base + ".pid"
        yield cmd, out, pid


def run_daemon(cmd, out, pid_file):
    if os.fork() > 0:
        return
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    lock = open(PID_DIR / f"{out}.lock", "w")
    os.set_inheritable(lock.fileno(), True)
    try:
        fcntl.lockf(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os._exit(0)  # "Daemon already running" (printed only with -v)
    fd = os.open(LOG_DIR / out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    (PID_DIR / pid_file).write_text(f"{os.getpid()}\n")
    os.chdir(TMP_DIR)
    os.environ["PATH"] = f"{PROJECT / 'bin'}:{os.environ.get('PATH', '')}"
    argv = shlex.split(cmd)
    os.execvp(argv[0], argv)


def start():
    (PROJECT / "stop_daemons").unlink(missing_ok=True)
    for d in (PID_DIR, LOG_DIR, TMP_DIR):
        d.mkdir(exist_ok=True)
    for cmd, out, pid in daemons():
        if (PROJECT / "bin" / shlex.split(cmd)[0]).is_file():
            run_daemon(cmd, out, pid)
    # the scheduler answers "project down" until the daemons are started
    (PROJECT / "stop_sched").unlink(missing_ok=True)


def stop():
    (PROJECT / "stop_sched").write_text("<stop/>\n")  # before the daemons are stopped
    (PROJECT / "stop_daemons").write_text("")
    for p in PID_DIR.glob("*.pid"):
        try:
            os.kill(int(p.read_text().split()[0]), signal.SIGHUP)
        except (OSError, ValueError, IndexError):
            pass


record(Path(sys.argv[0]).name)
{"start": start, "stop": stop}[Path(sys.argv[0]).name]()
