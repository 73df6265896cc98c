"""Simulated preemption of the local backend: kills, notices and crashes of slots."""

from __future__ import annotations

import time

from boinc_dl.client_app.boinc_io import atomic_write_bytes
from boinc_dl.server.backends.local.slots import _Slot, _slot_paths


class SimulatedPreemption:
    """LocalJobSystem's simulated spot reclaims: kills, notices and crashes of slots.

    A mixin of :class:`~boinc_dl.server.backends.local.jobsystem.LocalJobSystem`, whose
    ``__init__`` sets the state it uses."""

    def crash_slot(self, host: int, slot: int, restart: bool = False) -> None:
        """SIGKILL a slot process; with ``restart`` it comes back in place and resumes its unit."""
        with self.lock:
            s = self._slot(host, slot)
            if restart and s.busy:
                s.resume = s.busy
                self.counters["restarted_in_slot"] += 1
            elif s.busy:
                self._mark_lost(s.busy, time.time())
            self._kill_slot(s)

    def notify_preemption(self, host: int, slot: int) -> None:
        """Give host ``host``'s slot a preemption notice now (the notice path)."""
        with self.lock:
            self._notice(self._slot(host, slot), time.time())

    def _notice(self, slot: _Slot, now: float) -> None:
        if not slot.busy or slot.notice_at is not None:
            return
        _, notice_file = _slot_paths(self.base, slot.host, slot.index)
        notice_file.parent.mkdir(parents=True, exist_ok=True)
        # Created whole: the slot's watcher fires on the file existing.
        atomic_write_bytes(notice_file, b"local backend: host reclaimed\n")
        slot.notice_at, slot.kill_at = now, None
        self.counters["notices"] += 1
        self._mark_lost(slot.busy, now)

    def _check_slots(self, now: float) -> None:
        for slot in self.slots:
            if slot.kill_at is not None and now >= slot.kill_at and slot.busy and slot.proc is not None:
                # The spot VM is reclaimed mid-unit, for real.
                self.counters["preempted"] += 1
                self.kill_offsets.append(now - slot.busy_since)
                slot.kill_at, slot.down_since = None, now
                if self.preempt_mode == "notice":
                    self._notice(slot, now)
                elif self.preempt_mode == "restart":
                    slot.resume = slot.busy
                    self.counters["restarted_in_slot"] += 1
                    self._kill_slot(slot)
                else:
                    self._mark_lost(slot.busy, now)
                    self._kill_slot(slot)
            if slot.notice_at is not None and now - slot.notice_at > self.notice_grace_s and slot.proc:
                # The client never reported: the host goes anyway; the deadline will tell.
                self.counters["notice_unreported"] += 1
                slot.notice_at = None
                self._kill_slot(slot)
            if slot.proc is not None and slot.conn is not None and slot.proc.is_alive():
                continue
            if slot.proc is not None:
                self._slot_died(slot, now)
            if now >= slot.respawn_at:
                self._spawn(slot)
