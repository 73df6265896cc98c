"""Child processes for tests: mergers from a clean fork server, and a run's own processes.

A test worker may already hold TensorFlow's threads (an earlier test in the same
xdist worker trained a model): a child *forked* from it inherits their locks in
whatever state they were, and now and then died with SIGSEGV before its first merge.
Children here come from a fork server instead: a fresh, single-threaded interpreter
that imports the merge code once, so each child still starts in milliseconds and
never shares a parent's threads. Targets must be importable module-level functions.

A fork server's children inherit *its* environment, fixed when it started, not the
test's: :func:`process` hands the test's current environment (``monkeypatch.setenv``
included) to the child before the target runs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

import psutil

#: imported once by the fork server, so its children do not import them again
PRELOAD = ["numpy", "redis", "boinc_dl.server.assimilator.store", "boinc_dl.server.common.weights"]


def mp_context() -> BaseContext:
    """The context for merger processes and their queues: a fork server without TensorFlow."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _with_env(env: dict[str, str], target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(env)
    target(*args)


def process(target: Callable[..., Any], *args: Any) -> BaseProcess:
    """A not yet started child running ``target(*args)`` in this process's current environment."""
    return mp_context().Process(target=_with_env, args=(dict(os.environ), target, args))


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s children (none once it is gone)."""
    try:
        return [c.pid for c in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def _cpu_and_threads(pid: int) -> tuple[float, int]:
    try:
        p = psutil.Process(pid)
        t = p.cpu_times()
        return t.user + t.system, p.num_threads()
    except psutil.Error:
        return 0.0, 0


def busy_slot(run_pid: int) -> int | None:
    """A slot process of the ``boinc-dl run`` ``run_pid`` training a unit now: a child of
    its fork server with TensorFlow's thread pools up (an assimilator runs 2 threads),
    busy on the CPU over the last half second."""
    workers = [k for fs in children(run_pid) for k in children(fs)]
    before = {k: _cpu_and_threads(k)[0] for k in workers}
    time.sleep(0.5)
    busy = []
    for k in workers:
        cpu, threads = _cpu_and_threads(k)
        if threads >= 4 and cpu - before[k] >= 0.1:  # at least a fifth of a core
            busy.append((cpu - before[k], k))
    return max(busy)[1] if busy else None
