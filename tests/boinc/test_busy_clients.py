"""Keeping BOINC clients busy, on a simulated clock: a client that backs off exactly as
BOINC 7.20's does, against MOP's generator (barrier vs pipelined epochs) and VC-ASGD's
window (fixed vs sized from the active hosts), with and without ``next_rpc_delay``."""

from __future__ import annotations

import random
import statistics

import pytest

from tests.support.workfetch_sim import (
    NEED_WORK,
    PROJECT_REQ,
    RESULTS_DUE,
    Client,
    MOPGenerator,
    SimProject,
    VCASGDGenerator,
    simulate,
)


class _Empty:
    """A generator with nothing to hand out (the project has no tasks)."""

    def step(self, now):
        return []

    def done(self, unit):
        pass

    def work_left(self):
        return True

    def finished(self):
        return False


def test_backoff_is_boincs() -> None:
    """0.5-1.5 x 600 s, doubling up to a day, only after NEED_WORK/RESULTS_DUE RPCs."""
    c = Client(0, 1, random.Random(3))
    p = SimProject(_Empty())
    intervals = []
    now = 10.0
    for _ in range(10):
        c._rpc(p, now, NEED_WORK)
        wait = c.backoff_time - now
        intervals.append(c.backoff_interval)
        assert 0.5 * c.backoff_interval <= wait < 1.5 * c.backoff_interval
        now = c.backoff_time + 1
    assert intervals[:4] == [600, 1200, 2400, 4800] and intervals[-1] == 86400
    # While backed off, a failed request does not back off again (no doubling).
    c2 = Client(1, 1, random.Random(0))
    c2._rpc(p, 10, NEED_WORK)
    t, i = c2.backoff_time, c2.backoff_interval
    c2._rpc(p, 20, RESULTS_DUE)
    assert (c2.backoff_time, c2.backoff_interval) == (t, i)
    # A project-requested RPC never backs off, even when not backed off.
    c3 = Client(2, 1, random.Random(0))
    c3._rpc(p, 10, PROJECT_REQ)
    assert c3.backoff_interval == 0
    # Every reply's request_delay (7 s) holds the next RPC back; a task's upload
    # finishing clears the backoff (CLIENT_STATE::update_results): the client reports at
    # once (RESULTS_DUE) and, finding no work, backs off again from 600 s, not doubled.
    assert c3.min_rpc_time == 17
    c2.backoff_interval = 4800.0  # as after several empty replies
    c2.running = [(100.0, "u")]
    c2.tick(p, 100.0, 1.0, True)
    assert c2.ready == [] and c2.backoff_interval == 600 and c2.backoff_time > 100


def test_next_rpc_delay_brings_a_backed_off_client_back_with_a_work_request() -> None:
    gen = VCASGDGenerator(subsets=1, epochs=1, window=1)
    p = SimProject(gen, next_rpc_delay=60)
    c = Client(0, 1, random.Random(1))
    c._rpc(p, 5, NEED_WORK)  # nothing yet: backs off 300-900 s
    assert c.backoff_time > 300 and c.next_rpc_time == 65
    p.tick(10)  # the unit is created; sendable after the feeder's 5 s
    for now in range(6, 80):
        c.tick(p, float(now), 1.0, True)
        if c.running:
            break
    assert c.running and 65 < now <= 70  # back at next_rpc_time, during the backoff
    assert c.backoff_time == 0 and c.backoff_interval == 0  # work clears the backoff
    # Without next_rpc_delay the same client waits for its backoff to end.
    p0 = SimProject(VCASGDGenerator(1, 1, 1))
    c0 = Client(0, 1, random.Random(1))
    c0._rpc(p0, 5, NEED_WORK)
    p0.tick(10)
    for now in range(6, 2000):
        c0.tick(p0, float(now), 1.0, True)
        if c0.running:
            break
    assert now >= c0.backoff_interval * 0.5 and now > 300


def _mean_idle(pipelined: bool, delay: float, hosts: int, unit_s: float, seeds: int = 4) -> float:
    rs = [simulate(MOPGenerator(8, 4, 3, pipelined, seed=s), hosts, 2, next_rpc_delay=delay, unit_s=unit_s, seed=s)
          for s in range(seeds)]
    assert all(r.finished for r in rs)
    return statistics.mean(r.idle_share for r in rs)


@pytest.mark.parametrize("hosts", [1, 2])
def test_mop_pipelined_with_next_rpc_delay_keeps_hosts_busy(hosts: int) -> None:
    before = _mean_idle(False, 0, hosts, 300)
    after = _mean_idle(True, 60, hosts, 300)
    assert before > 0.08         # the barrier and the backoff
    assert after < 0.05 and after < before / 5  # the goal
    assert _mean_idle(True, 0, hosts, 300) > after and _mean_idle(False, 60, hosts, 300) > after


def test_vcasgd_window_from_hosts_feeds_every_host() -> None:
    fixed = simulate(VCASGDGenerator(64, 2, window=8), 16, 2, next_rpc_delay=60, unit_s=300, seed=1)
    sized = simulate(VCASGDGenerator(64, 2, window=None), 16, 2, next_rpc_delay=60, unit_s=300, seed=1)
    bounded = simulate(VCASGDGenerator(64, 2, window=None, bound=12), 16, 2, next_rpc_delay=60, unit_s=300, seed=1)
    assert fixed.finished and sized.finished and bounded.finished
    assert fixed.idle_share > 0.6 and sized.idle_share < 0.15
    assert sized.makespan_s < fixed.makespan_s / 2 and bounded.makespan_s > sized.makespan_s


def test_cost_of_next_rpc_delay_in_requests_per_host_hour() -> None:
    """Bounded by 3600 / next_rpc_delay plus the RPCs that fetch work and report."""
    gen = MOPGenerator(8, 4, 3, True, seed=0)
    r = simulate(gen, 2, 2, next_rpc_delay=60, unit_s=300, seed=0)
    units_per_host_hour = 8 * 4 * 3 / 2 / (r.makespan_s / 3600)
    assert r.rpcs_per_host_hour <= 60 + units_per_host_hour + 1


def test_request_delay_holds_back_reports_and_install_removes_it() -> None:
    """A reply's ``request_delay`` defers the host's next RPC, the report of a task that
    finished meanwhile included. With make_project --production's 6 s (7 s delay) a
    4-slot host reports some tasks 5-10 s late; with the 0 that install sets every task
    is reported at the next 5 s poll, for about the same number of scheduler requests."""
    from boinc_dl.server.backends.boinc.host_contact import (
        DEFAULT_MIN_SENDWORK_INTERVAL_S,
        request_delay_s,
    )

    def run(msi: float):  # noqa: ANN202
        return simulate(VCASGDGenerator(40, 3, None), hosts=2, slots=4, next_rpc_delay=60, unit_s=25,
                        request_delay=request_delay_s(msi), assimilate_s=7)

    prod, ours = run(6), run(DEFAULT_MIN_SENDWORK_INTERVAL_S)
    assert prod.finished and ours.finished
    assert prod.report_delay_max_s > 5.0 and prod.report_delay_median_s > ours.report_delay_median_s
    assert ours.report_delay_max_s < 5.0  # SCHEDULER_RPC_POLL_PERIOD
    assert ours.rpcs_per_host_hour <= 1.1 * prod.rpcs_per_host_hour


def test_short_units_need_a_prompt_generator_and_feeder() -> None:
    """The shipped example on one real 2-slot client (5 s tasks, merges 3.5 s after the
    report): with a generator pass every 5 s and BOINC's 5 s feeder sleep, the host that
    reports often asks again before the next units are sendable, gets "no tasks", backs
    off and waits for its next_rpc_delay; the real job did 3 units a minute and a half.
    Waking the generator on each merge and install's 1 s feeder sleep keep it fed."""
    def run(**server: float) -> list:  # noqa: ANN202 - SimResult
        return [simulate(VCASGDGenerator(8, 20, None), 1, 2, next_rpc_delay=60, unit_s=5.0, seed=s,
                         request_delay=0.0, assimilate_s=3.5, **server) for s in range(4)]

    before = run(poll_s=5.0, feeder_s=5.0)
    after = run(poll_s=5.0, feeder_s=1.0, wake_on_merge=True)
    assert all(r.finished for r in before + after)
    mean = statistics.mean
    assert mean(r.makespan_s for r in after) < mean(r.makespan_s for r in before) / 2.5
    assert mean(r.backoffs for r in after) < 5 < mean(r.backoffs for r in before)
    # each change alone helps less than both: a unit must exist *and* be sendable in time
    one = [run(poll_s=5.0, feeder_s=1.0), run(poll_s=5.0, feeder_s=5.0, wake_on_merge=True)]
    assert all(mean(r.makespan_s for r in after) < mean(r.makespan_s for r in x) / 1.5 for x in one)


def test_client_pace_reproduces_the_real_server() -> None:
    """With the 7.20 client's own pace (a task starts about 4 s after the reply that sent
    it, its upload is done about 6 s after it exits; docs/boinc.md, "Latency"), the
    simulation reproduces what the shipped example did on a real 1.6.2 server with one
    2-slot client: 52 units merged in the first 8 minutes, 160 units in 1,434 s, about 510
    scheduler requests an hour. Without the pace it is far too optimistic."""
    def run(max_s: float, fetch_s: float, upload_s: float) -> list[tuple[int, object]]:
        out = []
        for s in range(4):
            g = VCASGDGenerator(8, 20, None)
            r = simulate(g, 1, 2, next_rpc_delay=60, unit_s=5.0, seed=s, request_delay=0.0, assimilate_s=3.5,
                         feeder_s=1.0, wake_on_merge=True, fetch_s=fetch_s, upload_s=upload_s, max_s=max_s)
            out.append((g.merged, r))
        return out

    mean = statistics.mean
    first8 = mean(m for m, _ in run(480, 4.0, 6.0))
    assert 52 * 0.8 < first8 < 52 * 1.2
    whole = run(86400, 4.0, 6.0)
    assert all(r.finished for _, r in whole)
    assert 1434 * 0.8 < mean(r.makespan_s for _, r in whole) < 1434 * 1.2
    assert 510 * 0.8 < mean(r.rpcs_per_host_hour for _, r in whole) < 510 * 1.2
    assert mean(m for m, _ in run(480, 0.0, 0.0)) > 1.5 * first8  # the instantaneous client
