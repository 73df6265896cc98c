"""The job's totals across the runs that trained it (``boinc-dl run`` then ``--resume``)."""

from __future__ import annotations

from boinc_dl.server.run.jobclock import JobClock, describe_runs, end_clock, job_totals
from boinc_dl.server.run.lifecycle import record_heartbeat


def test_each_run_adds_its_time_up_to_its_last_heartbeat(tiny_job) -> None:
    store, _spec, _fp = tiny_job
    # run 1: trains 10 s, beats, then is SIGKILLed 0.4 s later (nothing written at the end)
    first = JobClock(store, t0=1000.0)
    store.set_meta(**first.fields(now=1010.0))
    # run 2, a day later: the pause is not the job's run time; it re-submits 3 units
    second = JobClock(store, t0=90_000.0, resubmitted=3)
    assert second.base == 10.0
    store.set_meta(**second.fields(now=90_004.5))
    for u in ("u0", "u1"):
        store.transition_unit(u, "created", "assimilated")
    totals = job_totals(store)
    assert totals["runs"] == 2 and totals["active_s"] == 14.5 and totals["resubmitted"] == 3, totals
    assert totals["merged"] == 2 and totals["reissued"] == 0 and totals["rejected"] == 0
    assert describe_runs(totals) == "2 runs, 14.5 s of run time, 3 unit(s) in flight re-submitted on resuming"


def test_the_heartbeat_writes_the_clock_and_the_end_writes_it_last(tiny_job) -> None:
    import time

    store, _spec, _fp = tiny_job
    store.set_meta(active_s=7.0)  # what earlier runs recorded
    clock = JobClock(store, t0=time.time() - 2.0)
    record_heartbeat(store, clock)
    assert 9.0 <= float(store.meta()["active_s"]) < 9.5
    time.sleep(0.2)
    totals = end_clock(store, clock)
    assert 9.2 <= totals["active_s"] < 9.8 and totals["runs"] == 1, totals
    assert describe_runs(totals).startswith("1 run, 9.")
