"""Unit bookkeeping of the local backend: instances, deadlines, re-issue and regeneration."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from boinc_dl.server.backends.base import RetryLimits
from boinc_dl.server.common import diskfaults
from boinc_dl.server.common.workunit import Workunit

REISSUE_POLICIES = ("same", "fresh")




# ---- bookkeeping --------------------------------------------------------------------------

@dataclass
class _Instance:
    name: str
    unit: str
    state: str = "unsent"  # unsent | in_progress | over
    slot: tuple[int, int] | None = None
    sent_at: float = 0.0
    deadline: float = 0.0
    outcome: str = ""  # success | no_reply | client_error | invalid | lost | cancelled
    lost_at: float | None = None  # when its host was reclaimed (kill or notice), if known
    app_restarts: int = 0  # its process killed from outside and restarted in its slot


@dataclass
class _Unit:
    wu: Workunit
    limits: RetryLimits
    name: str = ""  # the current workunit name: the unit, or <unit>_r<n> once regenerated
    attempt: int = 0
    instances: list[str] = field(default_factory=list)
    errors: int = 0
    done: bool = False
    cancelled: bool = False
    regen_since: float | None = None  # waiting for the generator to regenerate it
    lost_at: float | None = None  # loss not yet followed by a dispatch (latency metric)
    lost_via: str = ""


class UnitBook:
    """LocalJobSystem's unit bookkeeping: instances, deadlines, re-issue and regeneration.

    A mixin of :class:`~boinc_dl.server.backends.local.jobsystem.LocalJobSystem`, whose
    ``__init__`` sets the state it uses."""

    def set_reissue_policy(self, policy: str) -> None:
        """``same`` (BOINC's: re-issue the inputs) or ``fresh`` (regenerate, see module doc)."""
        if policy not in REISSUE_POLICIES:
            raise ValueError(f"re-issue policy must be one of {REISSUE_POLICIES}, got {policy!r}")
        self.reissue_policy = policy

    def regeneration_requests(self, job: str | None = None) -> list[tuple[str, int]]:
        """Units waiting to be regenerated with fresh weights: (unit, attempts so far).

        The local job system runs one job, so ``job`` (asked for by multi-job
        systems such as BOINC's) changes nothing."""
        with self.lock:
            return [(n, self.units[n].attempt) for n in sorted(self.regen_pending)]

    def resubmit_regenerated(self, unit: str, wu: Workunit, name: str) -> bool:
        """Issue the regenerated ``wu`` (named ``name``) for ``unit``.

        False if the unit no longer waits for it (merged by a late result, given up,
        cancelled, or already re-issued with its old inputs after ``regen_grace_s``).
        """
        with self.lock:
            u = self.units.get(unit)
            if u is None or unit not in self.regen_pending or u.done or u.cancelled:
                return False
            self.regen_pending.discard(unit)
            u.wu, u.name, u.regen_since = wu, name, None
            u.attempt += 1
            self.counters["regenerated"] += 1
            self._reissue(u, time.time())
        self._wake()
        return True

    def _new_instance(self, unit: str) -> None:
        u = self.units[unit]
        name = f"{u.name}_{len(u.instances)}"
        u.instances.append(name)
        self.instances[name] = _Instance(name, unit)
        self.unsent.append(name)

    def _drop_unsent(self, u: _Unit) -> None:
        for name in u.instances:
            inst = self.instances[name]
            if inst.state == "unsent":
                inst.state, inst.outcome = "over", "cancelled"
                try:
                    self.unsent.remove(name)
                except ValueError:
                    pass

    def _give_up(self, u: _Unit, reason: str) -> None:
        u.done = True
        self.regen_pending.discard(u.wu.unit)
        self.counters["given_up"] += 1
        self._deliver(self._assimilator_for(u), "error", "", u.wu.unit, reason)

    def _instance_failed(self, inst: _Instance, outcome: str) -> None:
        """An instance ended without a usable result: re-issue within the unit's limits."""
        inst.state, inst.outcome = "over", outcome
        u = self.units[inst.unit]
        if u.done or u.cancelled:
            return
        if outcome in ("client_error", "invalid"):
            u.errors += 1  # BOINC: no_reply and aborted-by-user are not errors
        if inst.lost_at is not None and u.lost_at is None:
            u.lost_at, u.lost_via = inst.lost_at, outcome
        live = [n for n in u.instances if self.instances[n].state != "over"]
        if live or u.regen_since is not None:
            return  # another instance is still running or queued
        if u.errors >= u.limits.max_error_results:
            self._give_up(u, f"too many errors ({u.errors}; last: {outcome})")
        elif len(u.instances) >= u.limits.max_total_results:
            self._give_up(u, f"too many total results ({len(u.instances)})")
        elif self.reissue_policy == "fresh" and outcome in ("no_reply", "lost"):
            u.regen_since = time.time()
            self.regen_pending.add(inst.unit)
            self.counters["regen_requested"] += 1
        else:
            self._reissue(u, time.time())

    def _reissue(self, u: _Unit, now: float) -> None:
        self.counters["reissued"] += 1
        if u.lost_at is not None:
            self.reissue_delays.append({"unit": u.wu.unit, "via": u.lost_via, "reissue_s": now - u.lost_at})
        self._new_instance(u.wu.unit)

    def _log_failure(self, unit: str, reason: str) -> None:
        if len(self.failure_log) < 1000:
            self.failure_log.append((unit, reason))

    def failures_since(self, index: int) -> list[tuple[str, str]]:
        """Failed instances (unit, reason) from position ``index`` of the failure log on."""
        with self.lock:
            return self.failure_log[index:]

    def _mark_lost(self, name: str, now: float) -> None:
        inst = self.instances.get(name)
        if inst is not None and inst.lost_at is None:
            inst.lost_at = now

    def _on_outcome(self, result: str, unit: str, status: str, reason: str, sent: tuple | None) -> None:
        if status == "merged":
            self.counters["merged"] += 1
        elif status == "duplicate":
            self.counters["duplicates"] += 1
        if status in ("merged", "duplicate") and sent is not None and sent[0] == "result" and sent[4]:
            # The file deleter's job, after the acknowledgement: never before it, or a
            # re-sent result would find its files gone. The merge log keeps what it needs:
            # a durable merge gave the weights file a second name (a hard link) in the
            # job's retained area before it was acknowledged (server/assimilator/retained.py).
            shutil.rmtree(Path(sent[4][0]).parent, ignore_errors=True)
        u = self.units.get(unit)
        if u is None:
            return
        if status in ("merged", "duplicate", "failed"):
            u.done = True
            self.regen_pending.discard(unit)
            self._drop_unsent(u)
        elif status == "rejected" and result:
            self.counters["rejected"] += 1
            self._log_failure(unit, f"result rejected: {reason}")
            inst = self.instances.get(result)
            if inst is not None and not u.done:
                inst.state = "in_progress"  # let _instance_failed account it
                self._instance_failed(inst, "invalid")

    def _server_fault(self, inst: _Instance | None, path: str, what: str, code: int | None) -> None:
        """The server's disk failed under an instance (or an assimilation): nothing is
        charged to the unit. The instance goes back to the front of the queue as it was
        (no error, no new instance) and dispatching stops: the run pauses (see
        :attr:`server_fault`) and ``--resume`` re-submits every unit in flight."""
        self.counters["server_faults"] += 1
        if inst is not None and inst.state == "in_progress":
            inst.state, inst.slot = "unsent", None
            self.unsent.appendleft(inst.name)
        if self.server_fault is None:
            self.server_fault = diskfaults.ServerResourceError(path, what, code=code)

    def _check_deadlines(self, now: float) -> None:
        if self.server_fault is not None:
            return  # paused: a deadline missed now would be the server's doing
        for inst in list(self.instances.values()):
            if inst.state == "in_progress" and now > inst.deadline:
                self.counters["timed_out"] += 1
                self._instance_failed(inst, "no_reply")

    def _check_regen(self, now: float) -> None:
        for unit in list(self.regen_pending):
            u = self.units[unit]
            if u.regen_since is not None and now - u.regen_since > self.regen_grace_s:
                # The generator could not regenerate it in time: re-issue the old inputs.
                self.regen_pending.discard(unit)
                u.regen_since = None
                self.counters["regen_fallback"] += 1
                self._reissue(u, now)
