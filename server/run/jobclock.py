"""A job's own story across the processes that ran it.

A job stopped or killed and continued with ``--resume`` is trained by several
``boinc-dl run`` processes. Each one's backend counters and elapsed time are its own; a
summary that showed only them ("16 merged, 18.4 s" for a 48-unit job that trained for a
minute over four runs) would misreport the job. This module keeps the job's totals in its
store, where every run adds to them:

* ``active_s`` (job meta): seconds the job has been run by any process, written with
  every heartbeat (so a SIGKILLed run's time is kept to within a heartbeat);
* ``runs`` (counter): processes that trained it;
* ``resubmitted`` (counter): units in flight when a run ended, submitted again by the
  next one (their merges stay exactly-once).

:func:`job_totals` reads them back, with the job-level fault counters the runs push.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.errors import BoincDLError

#: Counters this module owns; ``boinc-dl status`` shows them in words, not as counters.
RUN_COUNTERS = ("runs", "resubmitted")

#: The job-level fault counters shown beside them (pushed by every run, see
#: :class:`boinc_dl.server.run.lifecycle.CounterSync`; ``rejected`` by the assimilators).
FAULT_COUNTERS = ("reissued", "timed_out", "rejected", "given_up")


class JobClock:
    """This process's share of the job's run time and run count.

    Create it when this process starts training the job (after it resubmitted what was
    in flight, before its first heartbeat): it counts the run, and :meth:`fields` are
    written with each heartbeat so that the job's ``active_s`` stays current."""

    def __init__(self, store: JobStore, t0: float, resubmitted: int = 0):
        self.t0 = t0
        # Earlier runs' time: only heartbeats write ``active_s``, and this process has not
        # beaten yet, so this is the total of every process before it.
        try:
            self.base = max(0.0, float(store.meta().get("active_s", 0) or 0))
        except ValueError:
            self.base = 0.0
        store.incr_counter("runs")
        if resubmitted:
            store.incr_counter("resubmitted", resubmitted)

    def fields(self, now: float | None = None) -> dict[str, float]:
        """The job-meta fields to write now: the job's run time so far, and this run's."""
        mine = max(0.0, (now or time.time()) - self.t0)
        return {"active_s": round(self.base + mine, 3), "last_run_s": round(mine, 3)}


def job_totals(store: JobStore) -> dict[str, Any]:
    """The job's totals over every run: ``runs``, ``active_s`` (run time, pauses between
    runs excluded), ``merged`` units, units ``resubmitted`` by resumes and the job-level
    fault counters (:data:`FAULT_COUNTERS`)."""
    counters = store.counters()
    meta = store.meta()
    try:
        active = float(meta.get("active_s", 0) or 0)
    except ValueError:
        active = 0.0
    states = Counter(store.unit_states().values())
    return {"runs": max(1, counters.get("runs", 1)), "active_s": round(active, 3),
            "merged": states.get("assimilated", 0), "resubmitted": counters.get("resubmitted", 0),
            **{k: counters.get(k, 0) for k in FAULT_COUNTERS}}


def recorded_story(store: JobStore) -> dict[str, Any]:
    """What a finished job's summary holds of its runs, from its store: for a ``--resume``
    of a job whose finishing run was killed before it wrote ``summary.json``. ``elapsed_s``
    is the last run's time (as that run's summary would have said), ``job`` the totals."""
    totals = job_totals(store)
    # A store written before last_run_s: one run's time is the job's.
    last = totals["active_s"] if totals["runs"] == 1 else 0.0
    try:
        last = float(store.meta()["last_run_s"])
    except (KeyError, ValueError):
        pass
    return {"elapsed_s": last, "job": totals}


def describe_runs(totals: dict[str, Any]) -> str:
    """The job's runs in words (for ``status``): ``4 runs, 61.0 s of run time, 24 units
    re-submitted on resuming``."""
    runs = int(totals.get("runs", 1))
    text = f"{runs} run{'s' if runs != 1 else ''}, {float(totals.get('active_s', 0)):.1f} s of run time"
    if totals.get("resubmitted"):
        text += f", {totals['resubmitted']} unit(s) in flight re-submitted on resuming"
    return text


def end_clock(store: JobStore, clock: JobClock | None) -> dict[str, Any]:
    """At the end of a run: write the job's run time up to now (when this process trained
    it) and return :func:`job_totals`; ``{}`` when the store cannot say (Redis gone)."""
    try:
        if clock is not None:
            store.set_meta(**clock.fields())
        return job_totals(store)
    except BoincDLError:
        return {}
