"""BOINC's wrapper as the tests play it: how it signals the task it runs (a test double).

What ``samples/wrapper/wrapper.cpp`` and ``lib/proc_control.cpp`` do to the task process
(without ``<multi_process/>`` in job.xml), with the client's shared-memory messages
replaced by signals to this process:

* start: fork and exec the application (our launcher, an executable ``#!/bin/sh``
  script) in the slot directory;
* suspend (here ``SIGUSR1``): ``kill(pid, SIGSTOP)`` to the direct child only
  (``TASK::stop`` -> ``suspend_or_resume_process``);
* resume (``SIGUSR2``): ``kill(pid, SIGCONT)`` to the direct child only;
* quit or abort (``SIGTERM`` here; ``poll_boinc_messages``): ``kill_descendants(pid)``:
  list the descendants, ``SIGTERM`` to the child, wait up to 10 s (``--grace``) for them
  all to vanish, then ``SIGTERM`` (not SIGKILL: ``kill_all``) to every descendant listed,
  and ``exit(0)`` without waiting any longer;
* the child exits by itself: the wrapper exits with its status (``boinc_finish``).

Usage: ``python fake_wrapper.py [--grace S] APP [ARGS...]``; prints ``child <pid>``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (``get_descendants``: a /proc walk)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    """Exists and is not a zombie (``any_process_exists``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main(argv: list[str]) -> int:
    grace = 10.0
    if argv[:1] == ["--grace"]:
        grace, argv = float(argv[1]), argv[2:]
    child = subprocess.Popen(argv)  # noqa: S603 - the test's launcher
    print(f"child {child.pid}", flush=True)

    def suspend(signum: int, frame: object) -> None:
        os.kill(child.pid, signal.SIGSTOP)

    def resume(signum: int, frame: object) -> None:
        os.kill(child.pid, signal.SIGCONT)

    def quit_(signum: int, frame: object) -> None:
        desc = descendants(os.getpid())
        os.kill(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            child.poll()  # reap it, as the wrapper's waitpid in TASK::poll would
            if not any(alive(p) for p in desc):
                os._exit(0)
            time.sleep(0.2)
        for p in desc:
            try:
                os.kill(p, signal.SIGTERM)
            except ProcessLookupError:
                pass
        os._exit(0)

    signal.signal(signal.SIGUSR1, suspend)
    signal.signal(signal.SIGUSR2, resume)
    signal.signal(signal.SIGTERM, quit_)
    return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
