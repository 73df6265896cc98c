"""The fleet controller against the GCP stand-in, with the real google-cloud-compute
client (REST transport, anonymous credentials): MIG sizing, preemption operations ->
early re-issue, recreation under the same name with a new id (a life of its own:
counted, charged, and re-issued again when preempted again), the on-demand MIG
fallback and back."""

from __future__ import annotations

import time
from decimal import Decimal

import pytest
from google.auth.credentials import AnonymousCredentials

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.fleet.config import parse_config
from boinc_dl.server.fleet.controller import FleetController
from boinc_dl.server.fleet.cost import UNATTRIBUTED, cost_report
from boinc_dl.server.fleet.gcp import GcpProvider
from boinc_dl.server.fleet.provider import FleetShape
from boinc_dl.server.fleet.state import FleetState
from tests.fleet.conftest import boinc_hosts
from tests.fleet.gcp_standin import GcpStandin, World

ZONE = "us-central1-a"


@pytest.fixture
def gcp():
    w = World("bdl-test", ZONE)
    w.add_mig("bdl-spot", "g2-standard-4", 4)
    w.add_mig("bdl-ondemand", "g2-standard-4", 0)
    with GcpStandin(w) as s:
        yield w, s


def gcp_config(url: str, **over) -> object:
    data = {"provider": "gcp", "project": "/p", "max_hosts": 20, "slots_per_host": 1,
            "gcp": {"project": "bdl-test", "zone": ZONE, "mig": "bdl-spot", "machine_type": "g2-standard-4",
                    "on_demand_mig": "bdl-ondemand", "endpoint_url": url,
                    "spot_prices": {"g2-standard-4": "0.2827"}},
            "fallback": {"window_s": 600, "threshold": 0.2, "hold_s": 600, "on_demand_percent": 50}}
    data.update(over)
    return parse_config(data)


def test_provider_reads_and_acts_through_the_real_client(gcp) -> None:
    w, s = gcp
    p = GcpProvider(gcp_config(s.url).gcp, credentials=AnonymousCredentials())
    obs = p.observe()
    assert obs.shape == FleetShape(4, 0) and len(obs.instances) == 4
    i0 = obs.instances[0]
    assert i0.market == "spot" and i0.type == "g2-standard-4" and i0.state == "running" and i0.private_ip
    assert i0.launched > 0 and obs.interruptions == [] and obs.refusals == []
    p.apply(FleetShape(6, 50))
    assert (w.migs["bdl-spot"]["target"], w.migs["bdl-ondemand"]["target"]) == (3, 3)
    w.tick()
    w.exhausted = True
    p.apply(FleetShape(8, 50))
    w.tick()  # the groups try to create the new VMs: the zone has no capacity
    obs = p.observe()
    assert obs.refusals and obs.refusals[0].startswith("ZONE_RESOURCE_POOL_EXHAUSTED")
    assert {i.market for i in obs.instances} == {"spot", "on-demand"}
    assert ("POST", "instanceGroupManagers/bdl-ondemand/resize") in w.calls


def test_preemption_reissues_and_falls_back(gcp, boinc_db, project, redis_server) -> None:
    from tests.fleet.test_aws import boinc_job  # the same BOINC job as the AWS storm

    w, s = gcp
    r = connect(redis_server.url)
    store, units = boinc_job(r, project, "gcpjob", 6)
    now = [float(int(time.time()) - 3600)]  # whole seconds, as BOINC's send times
    w.clock = lambda: now[0]  # the cloud and the controller share a clock
    w.resize("bdl-spot", 0)
    w.resize("bdl-spot", 4)
    w.tick()
    cfg = gcp_config(s.url, project=str(project.root), min_hosts=4)
    ctl = FleetController(cfg, GcpProvider(cfg.gcp, credentials=AnonymousCredentials()), boinc_hosts(project),
                          FleetState(r, cfg.fleet_name()), clock=lambda: now[0])
    names = sorted(n for n in w.instances if w.instances[n]["mig"] == "bdl-spot")
    ids = {n: w.instances[n]["id"] for n in names}
    ctl.step()  # watched from the start
    now[0] += 3300  # up for 55 minutes
    for k, n in enumerate(names):  # GCP's hostname is the instance name: BOINC's domain_name
        boinc_db.send(units[k], boinc_db.add_host(n), now[0] - 300)
    rep = ctl.step()
    assert rep.desired == 4 and rep.running == 4 and rep.on_demand_percent == 0
    assert set(ctl.state.records()) == set(ids.values())  # keyed by id, never by name

    w.preempt(names[0])
    now[0] += 30
    rep = ctl.step()
    assert rep.reissued == [units[0]] and rep.replaced == [ids[names[0]]]
    assert units[0] in ctl.state.requested()
    # left to the group, which recreates it under the same name with a new id
    assert ("POST", "instanceGroupManagers/bdl-spot/recreateInstances") not in w.calls
    # 1 preemption over 4 hosts > 0.2: half the fleet on the on-demand MIG
    assert rep.on_demand_percent == 50
    assert (w.migs["bdl-spot"]["target"], w.migs["bdl-ondemand"]["target"]) == (2, 2)
    w.tick()
    assert w.instances[names[0]]["id"] != ids[names[0]]
    w.tick()
    now[0] += 30
    rep = ctl.step()
    # the recreated VM counts; the operation is handled once; the two VMs the spot group
    # deleted to make room for on-demand ones lost their units: re-issued too
    assert sorted(rep.reissued) == units[2:4] and rep.running == 4
    second = w.instances[names[0]]["id"]
    assert ctl.state.records()[second].name == names[0] and ctl.state.records()[second].settled_ms is None

    # the recreated VM (same name, new id) gets work and is preempted again: its own reclaim
    now[0] += 60
    boinc_db.send(units[4], boinc_db.add_host(names[0]), now[0])  # a fresh BOINC host row
    now[0] += 60
    w.preempt(names[0])
    now[0] += 30
    rep = ctl.step()
    assert rep.reissued == [units[4]]  # not skipped as "already handled"; units[0] not filed again
    assert len(ctl.state.reclaims_since(0)) == 2
    w.tick()

    # calm: past the window and hold_s, back to all spot
    now[0] += 700
    rep = ctl.step()
    # (five results in progress now: five hosts)
    assert rep.on_demand_percent == 0 and (w.migs["bdl-spot"]["target"], w.migs["bdl-ondemand"]["target"]) == (5, 0)
    assert any("calm" in x for x in rep.reasons)
    # both lives of the name were charged, each to its own end, at the SPOT price
    recs = ctl.state.records()
    first, second_rec = recs[ids[names[0]]], recs[second]
    assert first.end_ms == round(w.lives[ids[names[0]]]["ended"] * 1000) and first.settled_ms
    assert second_rec.end_ms == round(w.lives[second]["ended"] * 1000) and second_rec.settled_ms
    rep_job = cost_report(r, store.job)
    assert rep_job["reclaims"] == 2
    # lost: 300 s of the first life (the operation carries the real time), 60 s of the second,
    # 360 s of each VM deleted by the resize (up to when the controller found it gone)
    assert rep_job["lost_hours"] == Decimal("0.300") and rep_job["lost_usd"] == Decimal("0.08")
    assert rep_job["on_demand_usd"] > rep_job["total_usd"]
    spot = next(ln for ln in rep_job["lines"] if ln["market"] == "spot")
    assert abs(spot["usd"] - spot["hours"] * Decimal("0.2827")) < Decimal("0.000001")
    # while the job has results in flight, the whole fleet's time is the job's (idle hosts included)
    assert cost_report(r, UNATTRIBUTED)["total_usd"] == 0

    # a VM gone without a preemption operation: its unit is re-issued too, and it does not
    # count as a reclaim of the cloud (no fallback)
    w.instances[names[1]]["status"] = "TERMINATED"
    now[0] += 30
    rep = ctl.step()
    assert rep.reissued == [units[1]] and rep.on_demand_percent == 0
