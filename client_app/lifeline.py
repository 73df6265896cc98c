"""The task process under BOINC's wrapper: one process, tied to the wrapper's life.

BOINC's wrapper (``samples/wrapper``, ``TASK::stop/resume/kill``) signals only its
direct child: ``SIGSTOP``/``SIGCONT`` to suspend and resume, and on quit or abort
``SIGTERM``, up to 10 s of waiting, ``SIGTERM`` again to the descendants it saw, then
its own exit. So the launcher ``exec``s Python (no shell in between, which would be
the only process stopped, and could never reap a child once stopped), and this module
covers the two cases the wrapper's signals cannot:

* the wrapper exits or is SIGKILLed (a client quit while the task is suspended, the
  client's quit timeout): a stopped process never sees ``SIGTERM``, so the kernel's
  parent-death signal (``SIGKILL``) ends it; the last checkpoint is on disk;
* exit 75 after a spot-interruption notice while the VM lives on (a false alarm):
  wait ``BDL_RESUME_DELAY_S`` (180 s) for the VM to vanish, then ``execv`` the same
  command to resume from the checkpoint, at most ``BDL_MAX_RESUMES`` (3) times. An exit
  75 caused by a signal (the client asked the task to stop) is final.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, MutableMapping
from typing import Any

log = logging.getLogger("boinc_dl.client_app")

PARENT_ENV = "BDL_PARENT_PID"
RESUMES_ENV = "BDL_RESUMES"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    try:
        return max(0, int(raw)) if raw else default
    except ValueError:
        log.warning("ignoring %s=%r: not an integer", name, raw)
        return default


def tie_to_parent(env: Mapping[str, str] | None = None) -> bool:
    """Die with the launcher's parent (BOINC's wrapper): ``SIGKILL`` when it exits.

    Active only when the launcher exported ``BDL_PARENT_PID`` (a task under the
    wrapper), and only on Linux. If the parent is already gone (it died before the
    setting took effect), exit at once. Returns whether the tie is in place.
    """
    env = os.environ if env is None else env
    raw = env.get(PARENT_ENV, "").strip()
    if not raw or not sys.platform.startswith("linux"):
        return False
    try:
        expected = int(raw)
    except ValueError:
        log.warning("ignoring %s=%r: not a process id", PARENT_ENV, raw)
        return False
    import ctypes  # only on this path: ~5 ms

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return False
    if os.getppid() != expected:
        # the wrapper died between fork and here: nobody will ever collect our outputs
        log.warning("parent %d is gone: exiting", expected)
        os._exit(75)
    return True


def _wait_interruptibly(seconds: float) -> bool:
    """Sleep, ending early on SIGTERM/SIGINT/SIGHUP; returns True if a signal came."""
    stop = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, handler)
    return stop.wait(seconds)


def resume_after_notice(code: int, preempted: bool, argv: list[str],
                        env: MutableMapping[str, str] | None = None) -> int:
    """After exit 75 on a spot notice, wait for the VM to vanish, then re-exec ``argv``.

    Only under the launcher (``BDL_PARENT_PID`` set): run directly (the local backend),
    exit 75 goes to the caller, which re-issues or restarts the unit itself. Returns
    ``code`` unchanged when there is nothing to resume (another status, a signal-caused
    stop, resumes used up, a signal during the wait); otherwise it does not return
    (``os.execv`` replaces this process, keeping its pid for the wrapper).
    """
    env = os.environ if env is None else env
    if code != 75 or not preempted or not env.get(PARENT_ENV, "").strip():
        return code
    done = _env_int(env, RESUMES_ENV, 0)
    if done >= _env_int(env, "BDL_MAX_RESUMES", 3):
        return code
    delay = _env_int(env, "BDL_RESUME_DELAY_S", 180)
    log.warning("interrupted (checkpoint written); resuming in %d s (resume %d)", delay, done + 1)
    logging.shutdown()
    sys.stderr.flush()
    if _wait_interruptibly(delay):
        return code  # the client (or the VM's shutdown) wants us gone
    env[RESUMES_ENV] = str(done + 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)  # noqa: S606 - our own interpreter and arguments
    raise AssertionError("unreachable")  # pragma: no cover
