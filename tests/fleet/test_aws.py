"""The fleet controller against AWS in moto's server: an auto scaling group with a mixed
instances policy, EventBridge -> SQS interruption events, a reclaim storm, the
on-demand fallback, spot price history."""

from __future__ import annotations

import random
import time
from decimal import Decimal

import numpy as np
import pytest

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.boinc.jobsystem import BoincJobSystem
from boinc_dl.server.backends.boinc.registry import BoincRegistry
from boinc_dl.server.common.workunit import unit_name
from boinc_dl.server.fleet.aws import AwsProvider, parse_event
from boinc_dl.server.fleet.boinchosts import BoincHosts
from boinc_dl.server.fleet.config import parse_config
from boinc_dl.server.fleet.controller import FleetController
from boinc_dl.server.fleet.provider import FleetShape
from tests.boinc.conftest import make_project, tiny_fp
from tests.fleet.conftest import AMI, REGION, inject_spot_prices, make_fleet, put_interruptions


def aws_config(url: str, fleet: dict[str, str], project: str, **over) -> object:
    data = {"provider": "aws", "project": project, "min_hosts": 0, "max_hosts": 1000, "slots_per_host": 2,
            "aws": {"region": REGION, "asg_name": fleet["asg"], "queue_url": fleet["queue"], "endpoint_url": url},
            "fallback": {"window_s": 600, "threshold": 0.1, "hold_s": 900, "on_demand_percent": 50}}
    data.update(over)
    return parse_config(data)


def boinc_job(r, project, name: str = "storm", n_units: int = 200):
    """A VC-ASGD job of the BOINC project (reissue: fresh) whose units are all created in
    BOINC and in progress: the backend's issued ledger as BoincJobSystem writes it."""
    from tests.conftest import tiny_spec

    spec = tiny_spec(name, units={"timeout_s": 3600, "max_error_results": 3, "max_total_results": 6},
                     vcasgd={"n_subsets": n_units})
    store = JobStore(r, spec.name)
    store.create(spec.model_dump_json(), "vcasgd", {"0": tiny_fp()}, {"job_dir": str(project.job_dir(spec.name))})
    store.init_weights("0", np.zeros(tiny_fp().n_params, np.float32))
    store.set_meta(backend="boinc", boinc_project=str(project.root))
    units = [unit_name(spec.name, 1, k) for k in range(n_units)]
    now = time.time()
    import json

    for k, u in enumerate(units):
        store.register_unit(u, {"epoch": 1, "shard": k, "model": "0"}, 1)
        store.transition_unit(u, "created", "in_progress")
        r.hset(BoincRegistry(store).issued_key, u, json.dumps({"name": u, "t": now, "delay": 3600.0, "attempt": 0}))
        r.hset(BoincRegistry(store).live_key, u, u)  # created in BOINC, not yet handled by the assimilator
    return store, units


def running_members(session, url: str, asg: str) -> int:
    g = session.client("autoscaling", endpoint_url=url).describe_auto_scaling_groups(
        AutoScalingGroupNames=[asg])["AutoScalingGroups"][0]
    ec2 = session.client("ec2", endpoint_url=url)
    ids = [m["InstanceId"] for m in g["Instances"]]
    res = ec2.describe_instances(InstanceIds=ids)["Reservations"] if ids else []
    return sum(i["State"]["Name"] == "running" for rv in res for i in rv["Instances"])


def test_parse_event_rejects_what_is_not_an_interruption() -> None:
    good = ('{"id": "e1", "time": "2026-11-22T10:00:00Z", "detail-type": "EC2 Spot Instance Interruption Warning",'
            ' "source": "aws.ec2", "detail": {"instance-id": "i-0123456789abcdef0", "instance-action": "terminate"}}')
    ev = parse_event(good)
    assert ev and ev.kind == "warning" and ev.ends - ev.time == 120
    assert parse_event(good.replace("i-0123456789abcdef0", "../../etc/passwd")) is None
    assert parse_event(good.replace("Interruption Warning", "State-change Notification")) is None
    assert parse_event("[" * 100000) is None  # deep nesting: refused, not a crash
    assert parse_event("x" * (300 * 1024)) is None
    assert parse_event('{"detail-type": "EC2 Instance Rebalance Recommendation", "detail": {"instance-id": 5}}') is None
    sns = '{"Type": "Notification", "Message": ' + __import__("json").dumps(good) + "}"
    assert parse_event(sns).instance_id == "i-0123456789abcdef0"


def test_eventbridge_delivers_to_the_queue_and_provider_reads_it(aws_session, moto_url) -> None:
    fleet = make_fleet(aws_session, moto_url, 3)
    p = AwsProvider(aws_config(moto_url, fleet, "/nope").aws, aws_session)
    obs = p.observe()
    assert obs.shape == FleetShape(3, 0) and len(obs.instances) == 3
    assert {i.state for i in obs.instances} == {"running"} and all(i.private_ip for i in obs.instances)
    iid = obs.instances[0].id
    put_interruptions(aws_session, moto_url, [(iid, "rebalance", time.time()), (iid, "warning", time.time())])
    aws_session.client("sqs", endpoint_url=moto_url).send_message(QueueUrl=fleet["queue"], MessageBody="not json")
    evs = p.observe().interruptions
    assert sorted(e.kind for e in evs) == ["rebalance", "warning"] and {e.instance_id for e in evs} == {iid}
    assert p.observe().interruptions == []  # read messages were deleted


def test_reclaim_storm(aws_session, moto_url, boinc_db, redis_server, tmp_path) -> None:
    """100 hosts x 2 units; 30% reclaimed within a simulated minute: the group is back at
    100 running, each lost unit is filed once and handed to the work generator once."""
    project = make_project(tmp_path / "project")
    from boinc_dl.server.backends.boinc.install import InstallOptions, install

    install(project.root, InstallOptions(run_db_tools=False, gpu=False))
    r = connect(redis_server.url)
    store, units = boinc_job(r, project)
    fleet = make_fleet(aws_session, moto_url, 100)
    cfg = aws_config(moto_url, fleet, str(project.root))
    hosts = BoincHosts(boinc_db.conn, paramstyle="qmark")
    ctl = FleetController(cfg, AwsProvider(cfg.aws, aws_session), hosts, r)
    instances = ctl.provider.observe().instances
    assert len(instances) == 100
    on_host: dict[str, list[str]] = {}
    t0 = time.time()
    for k, inst in enumerate(instances):
        # half follow the host-name convention, half are found by their address
        hid = boinc_db.add_host(inst.id) if k % 2 else boinc_db.add_host("ip-unknown", ip=inst.private_ip)
        for u in units[2 * k:2 * k + 2]:
            boinc_db.send(u, hid, t0 - 600)
        on_host[inst.id] = units[2 * k:2 * k + 2]
    rep = ctl.step()
    assert rep.desired == 100 and rep.running == 100 and rep.reissued == []

    rng = random.Random(7)
    victims = rng.sample([i.id for i in instances], 30)
    storm_t = time.time()
    aws_session.client("ec2", endpoint_url=moto_url).terminate_instances(InstanceIds=victims[:20])
    events = [(v, "warning", storm_t + rng.uniform(0, 60)) for v in victims]
    events += [(v, "rebalance", storm_t) for v in victims[:5]]  # risk signals come first
    events += [(v, "warning", storm_t + 61) for v in victims[:10]]  # at-least-once delivery
    put_interruptions(aws_session, moto_url, events)

    periods = 0
    lost = sorted(u for v in victims for u in on_host[v])
    filed: list[str] = []
    while True:
        rep = ctl.step()
        periods += 1
        filed += rep.reissued
        if running_members(aws_session, moto_url, fleet["asg"]) == 100 or periods > 5:
            break
    assert running_members(aws_session, moto_url, fleet["asg"]) == 100
    assert periods == 1
    assert sorted(filed) == lost  # every lost unit filed, once
    be = BoincJobSystem(project, r)
    handed = be.regeneration_requests(store.job)
    assert sorted(u for u, _ in handed) == lost and all(a == 0 for _, a in handed)
    assert be.regeneration_requests(store.job) == []  # none twice
    # the same events delivered again: nothing is filed twice
    put_interruptions(aws_session, moto_url, [(v, "warning", storm_t + 62) for v in victims])
    assert ctl.step().reissued == []
    assert be.regeneration_requests(store.job) == []
    # 30 reclaims over 100 hosts in the window: half the fleet goes on-demand
    g = aws_session.client("autoscaling", endpoint_url=moto_url).describe_auto_scaling_groups(
        AutoScalingGroupNames=[fleet["asg"]])["AutoScalingGroups"][0]
    dist = g["MixedInstancesPolicy"]["InstancesDistribution"]
    assert dist["OnDemandPercentageAboveBaseCapacity"] == 50
    assert g["MixedInstancesPolicy"]["LaunchTemplate"]["Overrides"]  # the rest of the policy kept
    assert "reclaims" in ctl.fallback.reason


def test_sizing_budget_and_fallback_back(aws_session, moto_url, boinc_db, redis_server, monkeypatch) -> None:
    fleet = make_fleet(aws_session, moto_url, 2)
    now = [time.time()]
    cfg = aws_config(moto_url, fleet, "/p", budget_per_hour="2.00", max_hosts=50, min_hosts=1)
    r = connect(redis_server.url)
    hist = [(t, f"{REGION}a", now[0] - 7200, Decimal(p)) for t, p in
            (("g4dn.xlarge", "0.1578"), ("g5.xlarge", "0.3018"), ("c6i.xlarge", "0.0621"))]
    hist.append(("g4dn.xlarge", f"{REGION}a", now[0] - 1800, Decimal("0.2104")))
    inject_spot_prices(monkeypatch, hist)
    ctl = FleetController(cfg, AwsProvider(cfg.aws, aws_session), BoincHosts(boinc_db.conn, paramstyle="qmark"), r,
                          clock=lambda: now[0])
    for k in range(40):
        boinc_db.unsent(unit_name("j", 1, k))
    rep = ctl.step()  # 40 unsent, 2 slots: 20 hosts wanted; g4dn at 0.2104 $/h: the budget buys 9
    assert ctl.book.price("g4dn.xlarge", f"{REGION}a", "spot", now[0]) == Decimal("0.2104")
    assert ctl.book.price("g4dn.xlarge", f"{REGION}a", "spot", now[0] - 3600) == Decimal("0.1578")
    assert rep.desired == 9 and any("budget" in x for x in rep.reasons)
    assert running_members(aws_session, moto_url, fleet["asg"]) == 9

    # the cloud refuses spot capacity: fallback; calm for hold_s: back (hysteresis)
    ctl.fallback.last_trouble = 0
    from boinc_dl.server.fleet.controller import decide

    assert ctl.provider._refusals() == []
    rep2 = decide(cfg, hosts_demand := ctl.hosts.demand(), 9, Decimal("0.2"), ctl.fallback, 0,
                  ["InsufficientInstanceCapacity: no Spot capacity"], now[0])
    assert rep2.shape.on_demand_percent == 50 and "refused" in rep2.reasons[0]
    now[0] += 300
    assert decide(cfg, hosts_demand, 9, Decimal("0.2"), ctl.fallback, 0, [], now[0]).shape.on_demand_percent == 50
    now[0] += 900
    back = decide(cfg, hosts_demand, 9, Decimal("0.2"), ctl.fallback, 0, [], now[0])
    assert back.shape.on_demand_percent == 0 and "calm" in back.reasons[0]


def test_spot_market_is_read_from_instance_lifecycle(aws_session, moto_url) -> None:
    fleet = make_fleet(aws_session, moto_url, 0)
    ec2 = aws_session.client("ec2", endpoint_url=moto_url)
    ami = AMI
    out = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, InstanceType="g5.xlarge",
                            InstanceMarketOptions={"MarketType": "spot"})
    iid = out["Instances"][0]["InstanceId"]
    p = AwsProvider(aws_config(moto_url, fleet, "/p").aws, aws_session)
    (inst,) = p._describe({iid: {}})
    assert inst.market == "spot" and inst.type == "g5.xlarge" and inst.state == "running"
    (gone,) = p._describe({"i-00000000deadbeef0": {"InstanceType": "g5.xlarge"}})
    assert gone.state == "gone"


@pytest.mark.parametrize("bad, msg", [
    ({"provider": "aws"}, "project: Field required"),
    ({"provider": "aws", "project": "/p", "max_hosts": 3}, "the 'aws' section is missing"),
    ({"provider": "gcp", "project": "/p", "max_hosts": 0, "gcp": {"project": "p", "zone": "z", "mig": "m",
                                                                  "machine_type": "t"}},
     "max_hosts: Input should be greater than or equal to 1"),
    ({"provider": "gcp", "project": "/p", "max_hosts": 3, "gcp": {}}, "gcp.project: Field required (and 3 more)"),
    ({"provider": "aws", "project": "/p", "max_hosts": 3, "fallback": {"threshold": 2},
      "aws": {"region": "r", "asg_name": "a", "queue_url": "q"}}, "fallback.threshold"),
    ({"provider": "aws", "project": "/p", "max_hosts": 3, "budget": 5,
      "aws": {"region": "r", "asg_name": "a", "queue_url": "q"}}, "budget: Extra inputs"),
])
def test_config_errors_are_one_line_naming_the_field(bad, msg) -> None:
    from boinc_dl.server.fleet.config import FleetConfigError

    with pytest.raises(FleetConfigError) as e:
        parse_config(bad)
    assert msg in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["fleet-aws.yaml", "fleet-gcp.yaml"])
def test_examples_are_valid(name) -> None:
    from pathlib import Path

    from boinc_dl.server.fleet.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "examples" / name)
    assert cfg.provider == name.split("-")[1].split(".")[0] and cfg.max_hosts >= 1
