"""A unit left waiting in BOINC's queue goes out before the units of later epochs.

On a real server (BOINC master's scheduler, two 7.20 clients, the digits example) every
job scored 0 and BOINC's unstable sort of equal scores favoured new results: an epoch-1
unit waited ten minutes while the units of later epochs were sent around it, and all
four epochs closed at once when it finally merged. Workunits now carry ``--priority``
by epoch (``jobsystem.send_priority``), and the fake scheduler sorts by score and takes
the newest first among equals, as the real one mostly did.
"""

from __future__ import annotations

from boinc_dl.server.backends.boinc.jobsystem import PRIORITY_FLOOR, send_priority
from tests.boinc import fake_server
from tests.boinc.test_backend import LIMITS, make_inputs
from tests.boinc.test_semantics import create_units, job  # noqa: F401 - fixture


def test_a_waiting_unit_goes_before_later_epochs(job) -> None:  # noqa: F811
    project, store, spec, r = job
    be, first = create_units(project, r, spec, 3)  # epoch 1
    got = fake_server.request_work(project, hostid=1, ncpus=2, n_wanted=2)
    assert len(got) == 2
    (waiting,) = [u for u in first if f"{u}_0" not in got]
    # the window moves on: the next epoch's units are issued while one of epoch 1 waits
    later = make_inputs(project, spec.name, [f"{spec.name}__m0_e0002_s{i:04d}" for i in range(3)])
    for wu in later:
        be.submit(wu, LIMITS)
    be.flush()
    prio = {row["name"]: row["priority"] for row in fake_server.rows(project, "SELECT name, priority FROM workunit")}
    assert {prio[u] for u in first} == {0} and {prio[wu.unit] for wu in later} == {-1}
    assert fake_server.request_work(project, hostid=2, ncpus=1, n_wanted=1) == [f"{waiting}_0"]
    # then the later epoch's units, and a re-issued replica keeps its workunit's priority
    assert {n.rsplit("_", 1)[0] for n in fake_server.request_work(project, hostid=2, ncpus=4, n_wanted=3)} == \
        {wu.unit for wu in later}


def test_send_priority() -> None:
    assert send_priority(1) == 0
    assert send_priority(7) == -6
    assert send_priority(9_999_999) == PRIORITY_FLOOR
    assert send_priority(0) == 0  # never above 0: other apps' jobs keep their place

