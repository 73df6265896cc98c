"""A chaos thread: SIGKILL assimilator processes and Redis while a job runs.

Faults fire at chosen fractions of the job's progress, measured as merged units in
Redis over the job's total, so a plan means the same on a fast or a slow machine.
Assimilators are found through the job system when one is given, else among this
process's children by name (``run_job`` builds its job system internally), and are
killed with SIGKILL; Redis is SIGKILLed and restarted on its own data directory after
``redis_down_s`` (what a supervisor such as docker's ``restart: always`` does).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis
from boinc_dl.server.assimilator.store import PREFIX, JobStore


@dataclass
class ChaosPlan:
    """What to break, at which fraction (0..1) of the job's merges."""

    #: the i-th entry SIGKILLs assimilator ``i % P`` when that fraction is reached
    kill_assimilators_at: Sequence[float] = ()
    #: SIGKILL Redis at these fractions; it comes back after ``redis_down_s``
    restart_redis_at: Sequence[float] = ()
    redis_down_s: float = 1.0


@dataclass
class ChaosLog:
    """Faults injected, in order: (seconds since start, what, detail)."""

    events: list[tuple[float, str, str]] = field(default_factory=list)

    def count(self, what: str) -> int:
        return sum(1 for _t, w, _d in self.events if w == what)


def find_assimilator_pid(index: int) -> int | None:
    """PID of this process's live child ``bdl-assimilator-<index>``, if any."""
    for p in mp.active_children():
        if p.name == f"bdl-assimilator-{index}" and p.pid is not None:
            return p.pid
    return None


class ChaosMonkey(threading.Thread):
    """Runs a :class:`ChaosPlan` against a running job until :meth:`stop`."""

    def __init__(self, server: EmbeddedRedis, job: str, total_units: int, plan: ChaosPlan,
                 assimilators: int, backend: Any | None = None, poll_s: float = 0.05):
        super().__init__(name="bdl-chaos", daemon=True)
        self.server, self.job, self.total = server, job, max(1, total_units)
        self.plan, self.n_assim, self.backend, self.poll_s = plan, assimilators, backend, poll_s
        self.log = ChaosLog()
        self._halt = threading.Event()
        self._t0 = time.monotonic()
        events: list[tuple[float, str, int]] = [(f, "assimilator", i % assimilators)
                                                for i, f in enumerate(plan.kill_assimilators_at)]
        events += [(f, "redis", 0) for f in plan.restart_redis_at]
        self.pending = sorted(events)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)

    def _merged(self) -> int | None:
        try:
            r = redis.Redis.from_url(self.server.url, socket_connect_timeout=0.5, socket_timeout=2)
            try:
                return int(r.hlen(f"{PREFIX}:{self.job}:assimilated"))
            finally:
                r.close()
        except (redis.RedisError, OSError):
            return None

    def _note(self, what: str, detail: str) -> None:
        self.log.events.append((time.monotonic() - self._t0, what, detail))

    def _kill_assimilator(self, index: int) -> bool:
        if self.backend is not None:
            pid = self.backend.kill_assimilator(index)
        else:
            pid = find_assimilator_pid(index)
            if pid is None:
                return False
            os.kill(pid, signal.SIGKILL)
        self._note("assimilator_killed", f"assimilator {index} (pid {pid})")
        return True

    def _restart_redis(self) -> None:
        pid = self.server.pid
        self.server.kill()
        self._note("redis_killed", f"pid {pid}")
        self._halt.wait(self.plan.redis_down_s)
        self.server.restart()
        self._note("redis_restarted", f"pid {self.server.pid}")

    def run(self) -> None:
        while self.pending and not self._halt.is_set():
            merged = self._merged()
            if merged is not None:
                frac = merged / self.total
                while self.pending and frac >= self.pending[0][0]:
                    f, what, index = self.pending[0]
                    if what == "assimilator" and not self._kill_assimilator(index):
                        break  # not started yet (or between restarts): try again shortly
                    if what == "redis":
                        self._restart_redis()
                    self.pending.pop(0)
            self._halt.wait(self.poll_s)


def merge_while_killing(procs: Sequence[Any], acks: Any, kill: Any, every: int, *, kills: int = 2,
                        deadline_s: float = 120.0, join_s: float = 60.0) -> set[str]:
    """Start merger processes ``procs`` (each puts the units it merged on ``acks``); after
    each ``every`` acknowledged merges call ``kill(k, acked_so_far)`` (SIGKILL and restart
    something; check what must have survived), ``kills`` times. Every process must exit 0
    and every kill must have happened; returns the acknowledged units."""
    for p in procs:
        p.start()
    acked: set[str] = set()
    done = 0
    deadline = time.monotonic() + deadline_s
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        while not acks.empty():
            acked.add(acks.get())
        if done < kills and len(acked) >= every * (done + 1):
            kill(done, set(acked))
            done += 1
        time.sleep(0.01)
    for p in procs:
        p.join(join_s)
        assert p.exitcode == 0, f"merger exited {p.exitcode}"
    while not acks.empty():
        acked.add(acks.get())
    assert done == kills, f"{done} of {kills} kills happened"
    return acked


def kill_redis_checking(srv: EmbeddedRedis, job: str, down_s: float) -> Any:
    """A ``kill`` for :func:`merge_while_killing`: SIGKILL Redis, restart it after
    ``down_s``, and check every merge acknowledged before the kill is still marked."""
    def kill(_k: int, before: set[str]) -> None:
        srv.kill()
        time.sleep(down_s)
        srv.restart()
        marks = set(JobStore(connect(srv.url), job).assimilated())
        assert before <= marks, f"acknowledged merges lost: {sorted(before - marks)[:5]}"
    return kill
