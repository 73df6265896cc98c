"""The local backend's assimilator pool: child processes that merge results into the store."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from boinc_dl.server.backends.local.slots import (
    _FAST_DEATH_S,
    _FAST_DEATHS_FREE,
    _exit_with,
    _inbox,
    _respawn_delay,
    settled_exit,
)
from boinc_dl.server.backends.local.units import _Unit

log = logging.getLogger(__name__)

# Results sent to one assimilator but not yet acknowledged, at most: bounds what a
# slow assimilator can hold in its pipe, so the dispatcher never blocks on a send.
_MAX_IN_PIPE = 32



def assimilate_message(store: Any, spec: Any, kind: str, result: str, unit: str, payload: Any) -> Any:
    """The local backend's transport into the one assimilation path; raises only
    ``StoreUnavailable``.

    ``kind`` is ``result`` (``payload``: the result's file paths), ``error`` (the unit
    failed for good; ``payload``: the reason) or ``quarantine`` (a result that killed
    assimilators before; ``payload``: the reason). The unit is the backend's own record
    of what the slot ran, never the file's. A rejected result is not final here: the
    backend re-issues the unit (BOINC's transitioner does the same for an invalid result).
    Its hosts are the user's own processes: their results are trusted.
    """
    from boinc_dl.server.assimilator.framework import Delivery, assimilate, reject

    if kind == "quarantine":
        return reject(store, Delivery(unit, result, unit=unit, final=False), unit, payload)
    if kind == "error":
        return assimilate(store, Delivery(unit, result, unit=unit, error=payload, final=True), spec=spec)
    return assimilate(store, Delivery(unit, result, unit=unit, files=list(payload), final=False, trusted=True),
                      spec=spec)


def _assimilator_main(index: int, conn: Any, redis_url: str, job: str, owner: int) -> None:
    """One parameter-server process: validate + merge each result it is handed, then ack."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with(owner)
    from boinc_dl.server.assimilator.connection import connect
    from boinc_dl.server.assimilator.store import JobStore
    from boinc_dl.server.common import diskfaults
    from boinc_dl.server.common.diskfaults import ServerResourceError
    from boinc_dl.server.common.errors import StoreUnavailable
    from boinc_dl.server.common.spec import spec_from_json

    store: JobStore | None = None
    spec = None
    crash_after: int | None = None
    poison: set[str] = set()  # fault injection: units whose results kill this process
    conn.send(("ready", os.getpid()))
    for msg in _inbox(conn):
        if msg[0] == "arm":
            crash_after = int(msg[1])
            continue
        if msg[0] == "poison":
            poison.add(msg[1])
            continue
        kind, seq, result, unit, payload = msg
        if unit in poison and kind == "result":
            os.kill(os.getpid(), signal.SIGKILL)  # as a reader crashing on a malformed file would
        delay = 0.2
        out = None
        while True:
            try:
                if store is None:
                    store = JobStore(connect(redis_url, timeout=2.0), job)
                if spec is None:
                    try:
                        spec = spec_from_json(store.spec_json())
                    except StoreUnavailable:
                        raise
                    except Exception:  # noqa: BLE001 - job gone or spec unreadable: each
                        spec = None    # result is then rejected with that reason below
                out = assimilate_message(store, spec, kind, result, unit, payload)
                break
            except (StoreUnavailable, ServerResourceError) as e:
                fault = diskfaults.as_server_error(e, redis_url)
                if fault is not None:
                    # The server's disk (its files, Redis's append-only file): report it and
                    # leave the result unacknowledged; the run pauses, --resume redoes it.
                    conn.send(("fault", seq, result, unit, fault.path, fault.what, fault.code))
                    break
                # Transient: BOINC would re-run the assimilator later. Keep the result, retry.
                log.warning("assimilator %d: %s; retrying", index, e)
                store = None
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        if out is None:
            continue
        if out.status == "merged" and crash_after is not None:
            crash_after -= 1
            if crash_after <= 0:
                # Fault injection: the merge is committed, the acknowledgement never sent.
                os.kill(os.getpid(), signal.SIGKILL)
        conn.send(("ack", seq, result, unit or out.unit, out.status, out.reason))


# ---- bookkeeping --------------------------------------------------------------------------


@dataclass
class _Assimilator:
    index: int
    proc: Any = None
    conn: Any = None
    pending: dict[int, tuple] = field(default_factory=dict)  # seq -> message, until acknowledged
    queue: deque[int] = field(default_factory=deque)  # seqs not yet written to the pipe
    in_pipe: int = 0
    ready: bool = False
    spawned_at: float = 0.0
    fast_deaths: int = 0
    respawn_at: float = 0.0
    head_deaths: dict[int, int] = field(default_factory=dict)  # seq -> deaths while it was first


class AssimilatorPool:
    """LocalJobSystem's assimilator side: spawn, feed and restart the assimilator processes.

    A mixin of :class:`~boinc_dl.server.backends.local.jobsystem.LocalJobSystem`, whose
    ``__init__`` sets the state it uses."""

    def _spawn_assimilator(self, a: _Assimilator) -> None:
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=_assimilator_main, args=(a.index, child, self.redis_url, self.job, os.getpid()),
                             name=f"bdl-assimilator-{a.index}", daemon=True)
        p.start()
        child.close()
        a.proc, a.conn, a.in_pipe, a.ready, a.spawned_at = p, parent, 0, False, time.time()
        for unit in sorted(self.poisoned):
            parent.send(("poison", unit))

    def assimilator_pids(self) -> list[int | None]:
        with self.lock:
            return [a.proc.pid if a.proc is not None else None for a in self.assims]

    def kill_assimilator(self, index: int) -> int | None:
        """SIGKILL assimilator ``index`` (it is restarted and its pending results re-sent)."""
        with self.lock:
            a = self.assims[index]
            pid = a.proc.pid if a.proc is not None and a.proc.is_alive() else None
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        return pid

    def arm_assimilator_crash(self, index: int, after_merges: int = 1) -> None:
        """Make assimilator ``index`` SIGKILL itself right after its next ``after_merges``-th
        committed merge, before acknowledging it (the crash window of at-least-once)."""
        with self.lock:
            a = self.assims[index]
            if a.conn is None:
                raise RuntimeError(f"assimilator {index} is not running")
            a.conn.send(("arm", after_merges))

    def poison_unit(self, unit: str) -> None:
        """Make every result of ``unit`` SIGKILL the assimilator handed it, in every
        incarnation (a result that crashes a native reader): it must end quarantined."""
        with self.lock:
            self.poisoned.add(unit)
            for a in self.assims:
                if a.conn is not None:
                    a.conn.send(("poison", unit))

    def _assimilator_for(self, u: _Unit) -> _Assimilator:
        return self.assims[u.wu.wu_id % self.n_assim]

    def _deliver(self, a: _Assimilator, kind: str, result: str, unit: str, payload: Any) -> None:
        """Queue a message for an assimilator; it stays pending until acknowledged."""
        self.seq += 1
        a.pending[self.seq] = (kind, self.seq, result, unit, payload)
        a.queue.append(self.seq)
        self._pump(a)

    def _pump(self, a: _Assimilator) -> None:
        while a.conn is not None and a.queue and a.in_pipe < _MAX_IN_PIPE:
            seq = a.queue[0]
            msg = a.pending.get(seq)
            if msg is not None:
                try:
                    a.conn.send(msg)
                except (OSError, ValueError):
                    return  # dead: _check_assimilators restarts it and re-sends
                a.in_pipe += 1
            a.queue.popleft()

    def _drain_assimilator(self, a: _Assimilator) -> None:
        self._drain(a, lambda msg: self._on_assimilator_message(a, msg))

    def _on_assimilator_message(self, a: _Assimilator, msg: tuple) -> None:
        if msg[0] == "ready":
            a.ready, a.fast_deaths = True, 0
            return
        if msg[0] == "fault":  # a server-side I/O fault: the result stays pending, unacknowledged
            _, seq, _result, _unit, path, what, code = msg
            a.in_pipe = max(0, a.in_pipe - 1)
            a.head_deaths.pop(seq, None)
            self._server_fault(None, path, what, code)
            return
        _, seq, result, unit, status, reason = msg
        a.head_deaths.pop(seq, None)
        sent = a.pending.pop(seq, None)
        a.in_pipe = max(0, a.in_pipe - 1)
        self._on_outcome(result, unit, status, reason, sent)
        self._pump(a)

    def _check_assimilators(self) -> None:
        now = time.time()
        for a in self.assims:
            if a.proc is not None and a.conn is not None and a.proc.is_alive():
                continue
            if a.proc is not None:
                self._assimilator_died(a, now)
            if now >= a.respawn_at:
                self._spawn_assimilator(a)
                a.queue = deque(sorted(a.pending))
                self._pump(a)

    def _assimilator_died(self, a: _Assimilator, now: float) -> None:
        if a.conn is not None:  # read whatever it acknowledged before dying
            self._drain_assimilator(a)
            if a.conn is not None:
                a.conn.close()
        if a.proc.is_alive():  # its pipe broke: it cannot be trusted to carry on
            a.proc.kill()
        a.proc.join(timeout=1)
        exitcode = settled_exit(a.proc)  # an orphan of a dead fork server must not merge on
        early = not a.ready and now - a.spawned_at < _FAST_DEATH_S
        a.fast_deaths = a.fast_deaths + 1 if early else 0
        a.proc, a.conn, a.ready = None, None, False
        a.respawn_at = now + _respawn_delay(a.fast_deaths)
        self.counters["assimilator_restarts"] += 1
        self.counters["redelivered"] += len(a.pending)
        log.warning("assimilator %d died (exit %s): restarting it, re-sending %d result(s)",
                    a.index, exitcode, len(a.pending))
        if a.fast_deaths >= _FAST_DEATHS_FREE:
            log.error("assimilator %d keeps dying at start (%d times): next start in %.1f s",
                      a.index, a.fast_deaths, a.respawn_at - now)
        if a.pending:
            # The first pending result is the one it was working on: one that keeps
            # killing assimilators is a poison result, to be rejected, not re-sent forever.
            head = next(iter(a.pending))
            a.head_deaths[head] = a.head_deaths.get(head, 0) + 1
            # Only a result file can be poison; a give-up (--error) must get through.
            if a.head_deaths[head] >= self.poison_after and a.pending[head][0] == "result":
                kind, seq, result, unit, _payload = a.pending[head]
                reason = f"result killed the assimilator {a.head_deaths[head]} times in a row"
                a.pending[head] = ("quarantine", seq, result, unit, reason)
                self.counters["quarantined"] += 1
                log.error("result %s of unit %s quarantined: %s", result, unit, reason)
