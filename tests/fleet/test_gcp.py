"""The fleet controller against the GCP stand-in, with the real google-cloud-compute
client (REST transport, anonymous credentials): MIG sizing, preemption operations ->
early re-issue, recreation, the on-demand MIG fallback and back."""

from __future__ import annotations

import time
from decimal import Decimal

import pytest
from google.auth.credentials import AnonymousCredentials

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.fleet.boinchosts import BoincHosts
from boinc_dl.server.fleet.config import parse_config
from boinc_dl.server.fleet.controller import FleetController
from boinc_dl.server.fleet.gcp import GcpProvider
from boinc_dl.server.fleet.provider import FleetShape
from boinc_dl.server.fleet.reissue import REQUESTED_KEY
from tests.boinc.conftest import make_project
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


def test_preemption_reissues_and_falls_back(gcp, boinc_db, redis_server, tmp_path) -> None:
    from tests.fleet.test_aws import boinc_job  # the same BOINC job as the AWS storm

    w, s = gcp
    project = make_project(tmp_path / "project")
    r = connect(redis_server.url)
    store, units = boinc_job(r, project, "gcpjob", 4)
    now = [time.time()]
    cfg = gcp_config(s.url)
    ctl = FleetController(cfg, GcpProvider(cfg.gcp, credentials=AnonymousCredentials()),
                          BoincHosts(boinc_db.conn, paramstyle="qmark"), r, clock=lambda: now[0])
    names = sorted(n for n in w.instances if w.instances[n]["mig"] == "bdl-spot")
    from datetime import datetime, timezone

    for n in names:  # up for an hour already
        w.instances[n]["created"] = datetime.fromtimestamp(now[0] - 3600, timezone.utc).isoformat()
    for k, n in enumerate(names):  # GCP's hostname is the instance name: BOINC's domain_name
        hid = boinc_db.add_host(n)
        boinc_db.send(units[k], hid, now[0] - 300)
    rep = ctl.step()
    assert rep.desired == 4 and rep.running == 4 and rep.on_demand_percent == 0

    w.preempt(names[0])
    now[0] += 30
    rep = ctl.step()
    assert rep.reissued == [units[0]] and rep.replaced == [names[0]]
    assert r.zscore(REQUESTED_KEY, units[0]) is not None
    assert w.instances[names[0]]["action"] == "RECREATING"
    # 1 preemption over 4 hosts > 0.2: half the fleet on the on-demand MIG
    assert rep.on_demand_percent == 50
    assert (w.migs["bdl-spot"]["target"], w.migs["bdl-ondemand"]["target"]) == (2, 2)
    w.tick()
    now[0] += 30
    rep = ctl.step()
    assert rep.reissued == [] and rep.running == 4  # the same operation is not handled twice
    # calm: past the window and hold_s, back to all spot
    now[0] += 700
    rep = ctl.step()
    assert rep.on_demand_percent == 0 and (w.migs["bdl-spot"]["target"], w.migs["bdl-ondemand"]["target"]) == (4, 0)
    assert any("calm" in x for x in rep.reasons)
    # the preempted instance's time was charged at the SPOT price, the on-demand MIG's at list price
    from boinc_dl.server.fleet.cost import UNATTRIBUTED, cost_report

    rep_job = cost_report(r, store.job)
    assert rep_job["total_usd"] > 0 and rep_job["reclaims"] == 1
    # lost: the 300 s since the result was sent (the preemption op carries the real time)
    assert Decimal("0.08") <= rep_job["lost_hours"] <= Decimal("0.1") and rep_job["lost_usd"] == Decimal("0.02")
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
