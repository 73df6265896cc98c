"""BOINC's result rows combined with a job's merge records (server/planner/boinc_times.py):
which result a merge used, what is believed, and how it reaches the fleet plan."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest

from boinc_dl.server.planner.boinc_times import boinc_times
from boinc_dl.server.planner.calibrate import calibration_from_rows
from boinc_dl.server.planner.fleetfile import FleetFile


@dataclass(frozen=True)
class Row:
    name: str
    workunit: str
    hostid: int = 1
    outcome: int = 1
    validate_state: int = 1
    sent_time: float | None = 1000.0
    received_time: float | None = 1010.0
    elapsed_time: float | None = 3.0
    cpu_time: float | None = 2.5
    canonical: bool = True


U = "job__m0_e0001_s0000"


def merge(unit: str = U, wall: float = 2.0, t: float = 2000.0) -> dict:
    return {"unit": unit, "wall_s": wall, "train_s": wall - 0.4, "t": t, "examples_seen": 100}


def test_replicas_pair_the_canonical_one_and_late_results_none():
    rows = [Row(f"{U}_0", U, hostid=1, elapsed_time=3.0, canonical=True, received_time=1010),
            Row(f"{U}_1", U, hostid=2, elapsed_time=2.2, canonical=False, received_time=1015),
            # received after the merge at t=2000: not what the merge used, though canonical
            Row(f"{U}_r1_0", f"{U}_r1", hostid=3, elapsed_time=9.0, canonical=True, received_time=2500,
                sent_time=2400)]
    bt = boinc_times(rows, [merge(t=2000.0)], "job", "test")
    assert bt.paired == 1 and bt.overhead_s == pytest.approx(1.0)  # 3.0 - 2.0: the canonical replica
    assert bt.results == 3 and len(bt.hosts) == 3
    assert bt.network_queue_s == pytest.approx(12.8)  # the median of 7.0, 12.8 and 91.0
    by_host = {h.hostid: h for h in bt.hosts}
    assert by_host[2].overhead_s is None and by_host[1].overhead_s == pytest.approx(1.0)


def test_another_job_sharing_the_name_prefix_is_not_read():
    rows = [Row(f"{U}_0", U, elapsed_time=3.0), Row("job___m0_e0001_s0000_0", "job___m0_e0001_s0000",
                                                    elapsed_time=8.0, hostid=9)]
    bt = boinc_times(rows, [merge()], "job", "test")
    assert bt.results == 1 and [h.hostid for h in bt.hosts] == [1] and not bt.ignored


@pytest.mark.parametrize("bad, why", [
    ({"elapsed_time": -1.0}, "elapsed_time missing, negative or absurd"),
    ({"elapsed_time": 0.0}, "elapsed_time missing, negative or absurd"),
    ({"elapsed_time": math.nan}, "elapsed_time missing, negative or absurd"),
    ({"elapsed_time": math.inf}, "elapsed_time missing, negative or absurd"),
    ({"elapsed_time": 1e300}, "elapsed_time missing, negative or absurd"),
    ({"elapsed_time": None}, "elapsed_time missing, negative or absurd"),
    ({"received_time": 900.0}, "sent/received times missing or out of order"),
    ({"sent_time": 0.0}, "sent/received times missing or out of order"),
    ({"received_time": 1e30}, "sent/received times missing or out of order"),
    ({"elapsed_time": 60.0}, "elapsed_time longer than its turnaround"),
])
def test_unbelievable_rows_are_ignored_and_counted(bad, why):
    good = Row(f"{U}_0", U)
    rows = [good, replace(good, name=f"{U}_1", canonical=False, **bad)]
    bt = boinc_times(rows, [merge()], "job", "test")
    assert bt.results == 1 and bt.ignored == {why: 1}
    assert bt.elapsed_s == 3.0 and bt.overhead_s == pytest.approx(1.0)


def test_an_absurd_cpu_time_keeps_the_other_times():
    bt = boinc_times([Row(f"{U}_0", U, cpu_time=1e300)], [merge()], "job", "test")
    assert bt.results == 1 and bt.cpu_s is None and bt.ignored == {"cpu_time absurd (the row's other times kept)": 1}


def test_an_app_wall_time_beyond_the_elapsed_time_is_not_paired():
    bt = boinc_times([Row(f"{U}_0", U, elapsed_time=3.0)], [merge(wall=5.0)], "job", "test")
    assert bt.paired == 0 and bt.overhead_s is None
    assert bt.ignored == {"app wall time longer than BOINC's elapsed_time": 1}


def test_failed_results_are_counted_not_timed_and_nothing_usable_is_an_error():
    rows = [Row(f"{U}_0", U, outcome=3), Row(f"{U}_1", U, validate_state=2), Row(f"{U}_2", U, elapsed_time=-4)]
    with pytest.raises(ValueError, match=r"no successful result of job 'job' with believable times \(2 failed\) "
                                         r"\(1 ignored: 1 elapsed_time"):
        boinc_times(rows, [merge()], "job", "test")
    with pytest.raises(ValueError, match="no successful result"):
        boinc_times([], [merge()], "job", "test")


def test_fleet_costs_take_the_host_side_and_the_network_time():
    rows = [Row(f"{U}_0", U, elapsed_time=3.0, sent_time=1000, received_time=1010)]
    units = [{**merge(), "cpu_s": 1.9, "train_cpu_s": 1.5}]
    cal = calibration_from_rows(units, "test")
    ff = FleetFile({"t": {"speed": 1.0}})
    plain = ff.server_costs(1000, cal)
    assert plain.stage_s == pytest.approx(0.4) and plain.dispatch_s == pytest.approx(0.05)
    cal = replace(cal, boinc=boinc_times(rows, units, "job", "test"))
    costs = ff.server_costs(1000, cal)
    assert costs.stage_s == pytest.approx(0.4 + 1.0)  # the app's own + BOINC's host side
    assert costs.dispatch_s == pytest.approx(7.0)  # received - sent - elapsed
    # A fleet file's own numbers still win.
    ff.costs = {"stage_s": 0.2, "dispatch_s": 0.1}
    assert (ff.server_costs(1000, cal).stage_s, ff.server_costs(1000, cal).dispatch_s) == (0.2, 0.1)
