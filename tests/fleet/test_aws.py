"""The fleet controller against AWS in moto's server: an auto scaling group with a mixed
instances policy, EventBridge -> SQS interruption events, a reclaim storm (drained, not
terminated), the on-demand fallback, spot price history, the budget from the first
period, a rebalance then a warning counted once, a warning handled only once it is
durable."""

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
from boinc_dl.server.fleet.aws import AwsProvider, ended_at, parse_event
from boinc_dl.server.fleet.config import parse_config
from boinc_dl.server.fleet.controller import FleetController
from boinc_dl.server.fleet.cost import cost_report
from boinc_dl.server.fleet.decide import decide
from boinc_dl.server.fleet.provider import FleetShape
from boinc_dl.server.fleet.state import FleetState
from tests.boinc.conftest import tiny_fp
from tests.fleet.conftest import (
    AMI,
    REGION,
    backdate_launch,
    boinc_hosts,
    ec2_reclaim,
    inject_spot_prices,
    make_fleet,
    put_interruptions,
)


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
    assert parse_event(sns).uid == "i-0123456789abcdef0"


def controller(cfg, session, project, r, **kw) -> FleetController:  # noqa: ANN001
    """The controller as the daemon builds it: BOINC's hosts through BoincDB, its state in Redis."""
    return FleetController(cfg, AwsProvider(cfg.aws, session), boinc_hosts(project), FleetState(r, cfg.fleet_name()),
                           **kw)


def ec2_instances(session, url: str) -> list[dict]:
    ec2 = session.client("ec2", endpoint_url=url)
    return [i for rv in ec2.describe_instances()["Reservations"] for i in rv["Instances"]]


def queued(session, url: str, queue: str) -> int:
    """Messages in the queue, visible or received and not yet deleted."""
    attrs = session.client("sqs", endpoint_url=url).get_queue_attributes(
        QueueUrl=queue, AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])
    return sum(int(v) for v in attrs["Attributes"].values())


def test_eventbridge_delivers_and_a_message_goes_once_handled(aws_session, moto_url, monkeypatch) -> None:
    import boinc_dl.server.fleet.aws as aws

    monkeypatch.setattr(aws, "VISIBILITY_S", 1)
    fleet = make_fleet(aws_session, moto_url, 3)
    p = AwsProvider(aws_config(moto_url, fleet, "/nope").aws, aws_session)
    obs = p.observe()
    assert obs.shape == FleetShape(3, 0) and len(obs.instances) == 3
    assert {i.state for i in obs.instances} == {"running"} and all(i.private_ip for i in obs.instances)
    assert all(i.uid == i.name and i.member for i in obs.instances)
    assert sorted(obs.candidates) == sorted((t, f"{REGION}a") for t in ("g4dn.xlarge", "g5.xlarge", "c6i.xlarge"))
    iid = obs.instances[0].uid
    put_interruptions(aws_session, moto_url, [(iid, "rebalance", time.time()), (iid, "warning", time.time())])
    aws_session.client("sqs", endpoint_url=moto_url).send_message(QueueUrl=fleet["queue"], MessageBody="not json")
    evs = p.observe().interruptions
    assert sorted(e.kind for e in evs) == ["rebalance", "warning"] and {e.uid for e in evs} == {iid}
    assert all(e.receipt for e in evs)
    assert p.poll_interruptions() == []  # received: hidden for a while, not deleted
    time.sleep(1.5)  # a controller that died holding them: they come back
    again = p.poll_interruptions()
    assert sorted(e.kind for e in again) == ["rebalance", "warning"]
    p.ack(again)
    assert queued(aws_session, moto_url, fleet["queue"]) == 0  # handled ones and the junk deleted


def test_ended_at_reads_ec2s_transition_reason() -> None:
    assert ended_at("User initiated (2026-11-22 10:00:05 GMT)") == 1795341605.0
    assert ended_at("Service initiated (2026-11-22 10:00:05 UTC)") == 1795341605.0
    assert ended_at("") is None and ended_at("Server.InternalError") is None


def lay_out(boinc_db, instances, units, sent: float) -> dict[str, list[str]]:  # noqa: ANN001
    """Each instance's BOINC host (half by the host-name convention, half by address)
    holds two results."""
    on_host = {}
    for k, inst in enumerate(instances):
        hid = boinc_db.add_host(inst.uid) if k % 2 else boinc_db.add_host("ip-unknown", ip=inst.private_ip)
        for u in units[2 * k:2 * k + 2]:
            boinc_db.send(u, hid, sent)
        on_host[inst.uid] = units[2 * k:2 * k + 2]
    return on_host


def test_reclaim_storm_drains_and_counts_each_instance_once(aws_session, moto_url, boinc_db, project,
                                                            redis_server) -> None:
    """40 hosts x 2 units; 12 reclaimed (8 already terminated by EC2 when the controller
    looks, 4 only warned; rebalances first, duplicates after): each lost unit filed once,
    the warned ones drained (detached: the group launches replacements now, EC2 reclaims
    them), one replacement per reclaim, 12 reclaims counted, their first-hour bills waived."""
    from boinc_dl.server.backends.boinc.install import InstallOptions, install

    install(project.root, InstallOptions(run_db_tools=False, gpu=False))
    r = connect(redis_server.url)
    store, units = boinc_job(r, project, n_units=80)
    fleet = make_fleet(aws_session, moto_url, 40)
    cfg = aws_config(moto_url, fleet, str(project.root))
    ctl = controller(cfg, aws_session, project, r)
    # a fleet that has run for a while (minutes, within the first hour) when the storm hits
    rng0 = random.Random(3)
    ids = [i.uid for i in ctl.provider.observe().instances]
    backdate_launch(ids, {i: time.time() - rng0.uniform(120, 1800) for i in ids})
    instances = ctl.provider.observe().instances
    on_host = lay_out(boinc_db, instances, units, time.time())
    rep = ctl.step()
    assert rep.desired == 40 and rep.running == 40 and rep.reissued == []

    rng = random.Random(7)
    victims = rng.sample([i.uid for i in instances], 12)
    storm_t = time.time()
    ec2_reclaim(aws_session, moto_url, victims[:8])
    events = [(v, "warning", storm_t - rng.uniform(0, 20)) for v in victims]
    events += [(v, "rebalance", storm_t - 30) for v in victims[:5]]  # risk signals come first
    events += [(v, "warning", storm_t) for v in victims[:4]]  # at-least-once delivery
    put_interruptions(aws_session, moto_url, events)
    lost = sorted(u for v in victims for u in on_host[v])
    rep = ctl.step()
    assert sorted(rep.reissued) == lost  # every lost unit filed, once
    assert running_members(aws_session, moto_url, fleet["asg"]) == 40  # replacements launched now
    assert rep.draining == 4 and rep.running == 36  # as observed before the replacements
    assert len(ec2_instances(aws_session, moto_url)) == 52  # one replacement per reclaim: no double launch
    be = BoincJobSystem(project, r)
    handed = be.regeneration_requests(store.job)
    assert sorted(u for u, _ in handed) == lost and all(a == 0 for _, a in handed)
    assert be.regeneration_requests(store.job) == []  # none twice
    # the same events delivered again: nothing is filed or counted twice
    put_interruptions(aws_session, moto_url, [(v, "warning", storm_t + 1) for v in victims])
    rep = ctl.step()
    assert rep.reissued == [] and be.regeneration_requests(store.job) == []
    assert rep.running == 40 and rep.draining == 4
    assert len(ctl.state.reclaims_since(0)) == 12
    # 12 reclaims over 40 hosts in the window: half the fleet goes on-demand
    g = aws_session.client("autoscaling", endpoint_url=moto_url).describe_auto_scaling_groups(
        AutoScalingGroupNames=[fleet["asg"]])["AutoScalingGroups"][0]
    assert g["MixedInstancesPolicy"]["InstancesDistribution"]["OnDemandPercentageAboveBaseCapacity"] == 50
    assert g["MixedInstancesPolicy"]["LaunchTemplate"]["Overrides"]  # the rest of the policy kept
    fb = ctl.state.fallback()
    assert fb.active and "12 reclaims in 600s over 40 hosts" in fb.reason  # the fleet as it was
    # EC2 reclaims the drained ones; their lives are settled, all within their first hour: free
    ec2_reclaim(aws_session, moto_url, victims[8:])
    rep = ctl.step()
    assert rep.draining == 0
    assert all(ctl.state.records()[v].settled_ms for v in victims)
    job = cost_report(r, store.job)
    assert job["reclaims"] == 12 and job["waived_n"] == 12 and job["drain_saved_usd"] >= 0
    assert len(ec2_instances(aws_session, moto_url)) == 52


def test_terminate_action_stops_at_once_and_is_billed(aws_session, moto_url, boinc_db, project, redis_server) -> None:
    r = connect(redis_server.url)
    store, units = boinc_job(r, project, n_units=4)
    fleet = make_fleet(aws_session, moto_url, 2)
    cfg = aws_config(moto_url, fleet, str(project.root), reclaim_action="terminate")
    ctl = controller(cfg, aws_session, project, r)
    instances = ctl.provider.observe().instances
    lay_out(boinc_db, instances, units, time.time())
    ctl.step()
    victim = instances[0].uid
    put_interruptions(aws_session, moto_url, [(victim, "warning", time.time())])
    assert sorted(ctl.fast_path()) == sorted(units[:2])
    ec2 = {i["InstanceId"]: i for i in ec2_instances(aws_session, moto_url)}
    assert ec2[victim]["State"]["Name"] == "terminated" and len(ec2) == 3  # stopped now, one replacement
    ctl.step()
    rec = ctl.state.records()[victim]
    assert rec.terminated_ms and rec.settled_ms and rec.end_ms == round(ended_at(ec2[victim]["StateTransitionReason"]) * 1000)
    job = cost_report(r, store.job)
    assert job["waived_n"] == 0 and job["reclaims"] == 1 and job["total_nusd"] > 0  # the owner's stop: billed


def test_rebalance_then_warning_is_one_reclaim(aws_session, moto_url, boinc_db, project, redis_server) -> None:
    r = connect(redis_server.url)
    store, units = boinc_job(r, project, n_units=6)
    fleet = make_fleet(aws_session, moto_url, 3)
    cfg = aws_config(moto_url, fleet, str(project.root), reissue_on_rebalance=True)
    ctl = controller(cfg, aws_session, project, r)
    instances = ctl.provider.observe().instances
    lay_out(boinc_db, instances, units, time.time())
    ctl.step()
    put_interruptions(aws_session, moto_url, [(i.uid, "rebalance", time.time()) for i in instances])
    assert sorted(ctl.step().reissued) == sorted(units)  # re-issued on the risk signal, as configured
    assert ctl.state.reclaims_since(0) == [] and ctl.state.records()[instances[0].uid].action == ""
    put_interruptions(aws_session, moto_url, [(i.uid, "warning", time.time()) for i in instances])
    rep = ctl.step()
    assert rep.reissued == [] and len(ctl.state.reclaims_since(0)) == 3
    assert cost_report(r, store.job)["reclaims"] == 3  # not 6


def _two_hosts(aws_session, moto_url, boinc_db, project, redis_server):  # noqa: ANN001, ANN202
    """A fleet of 2 hosts, each holding 2 results of a 4-unit job: Redis, the job's store,
    its units, the controller, the instances and the fleet's resources."""
    r = connect(redis_server.url)
    store, units = boinc_job(r, project, n_units=4)
    fleet = make_fleet(aws_session, moto_url, 2)
    ctl = controller(aws_config(moto_url, fleet, str(project.root)), aws_session, project, r)
    instances = ctl.provider.observe().instances
    lay_out(boinc_db, instances, units, time.time())
    return r, store, units, ctl, instances, fleet


def test_an_instance_gone_without_a_notice_then_warned_counts_its_reclaim_once(
        aws_session, moto_url, boinc_db, project, redis_server) -> None:
    """EC2 ends an instance whose warning the controller has not read yet (a controller
    down when it came, its message not visible again until the queue's timeout): the
    instance is first known only as gone, its units re-issued; the warning that follows
    makes it a reclaim, counted for the job once (it was not counted at all)."""
    r, store, units, ctl, instances, _fleet = _two_hosts(aws_session, moto_url, boinc_db, project, redis_server)
    ctl.step()
    victim = instances[0].uid
    ec2_reclaim(aws_session, moto_url, [victim])
    assert sorted(ctl.step().reissued) == sorted(units[:2])
    assert ctl.state.records()[victim].vanished and cost_report(r, store.job)["reclaims"] == 0
    put_interruptions(aws_session, moto_url, [(victim, "warning", time.time() - 5)])
    assert ctl.step().reissued == []  # filed already
    assert len(ctl.state.reclaims_since(0)) == 1
    assert cost_report(r, store.job)["reclaims"] == 1
    put_interruptions(aws_session, moto_url, [(victim, "warning", time.time() - 5)])  # delivered again
    ctl.step()
    assert len(ctl.state.reclaims_since(0)) == 1 and cost_report(r, store.job)["reclaims"] == 1


def test_a_warning_is_acknowledged_only_once_handled(aws_session, moto_url, boinc_db, project, redis_server,
                                                     monkeypatch) -> None:
    """A controller dying after filing the units and before marking the reclaim: the
    warning comes back, the same units are not filed twice, the reclaim counts once."""
    import boinc_dl.server.fleet.aws as aws

    monkeypatch.setattr(aws, "VISIBILITY_S", 1)
    r = connect(redis_server.url)
    store, units = boinc_job(r, project, n_units=2)
    fleet = make_fleet(aws_session, moto_url, 1)
    ctl = controller(aws_config(moto_url, fleet, str(project.root)), aws_session, project, r)
    (inst,) = ctl.provider.observe().instances
    lay_out(boinc_db, [inst], units, time.time())
    ctl.step()
    put_interruptions(aws_session, moto_url, [(inst.uid, "warning", time.time())])
    real = ctl.state.commit
    calls = []

    def dies_once(c, horizon):  # noqa: ANN001, ANN202
        if c.reclaims and not calls:
            calls.append(c)
            raise RuntimeError("killed")
        return real(c, horizon)

    monkeypatch.setattr(ctl.state, "commit", dies_once)
    with pytest.raises(RuntimeError):
        ctl.fast_path()
    assert set(ctl.state.requested()) == set(units) and ctl.state.records()[inst.uid].reclaim_ms is None
    assert queued(aws_session, moto_url, fleet["queue"]) == 1  # not acknowledged
    time.sleep(1.5)
    assert ctl.fast_path() == []  # handled now: nothing new to file
    assert ctl.state.records()[inst.uid].reclaim_ms is not None and len(ctl.state.reclaims_since(0)) == 1
    assert queued(aws_session, moto_url, fleet["queue"]) == 0


def test_a_warning_for_an_instance_never_seen(aws_session, moto_url, boinc_db, project, redis_server) -> None:
    """Warned and reclaimed while no controller watched: the instance is no longer in the
    group, but EC2 still knows it (tagged with the group's name): its units are re-issued.
    A warning for an instance of no fleet of ours is dropped."""
    r, store, units, ctl, instances, fleet = _two_hosts(aws_session, moto_url, boinc_db, project, redis_server)
    gone = instances[0].uid
    ec2_reclaim(aws_session, moto_url, [gone])  # the group drops it and launches another
    stranger = aws_session.client("ec2", endpoint_url=moto_url).run_instances(
        ImageId=AMI, MinCount=1, MaxCount=1, InstanceType="g5.xlarge")["Instances"][0]["InstanceId"]
    put_interruptions(aws_session, moto_url, [(gone, "warning", time.time() - 100),
                                              (stranger, "warning", time.time())])
    rep = ctl.step()  # the controller's first look at this fleet
    assert sorted(rep.reissued) == sorted(units[:2])
    recs = ctl.state.records()
    assert gone in recs and recs[gone].reclaim_ms and recs[gone].settled_ms and stranger not in recs
    assert queued(aws_session, moto_url, fleet["queue"]) == 0  # both handled: the stranger's dropped


def test_budget_applies_from_the_first_period(aws_session, moto_url, boinc_db, project, redis_server,
                                              monkeypatch) -> None:
    """Nothing runs yet: a new host is priced at the dearest type the group may launch."""
    fleet = make_fleet(aws_session, moto_url, 0)
    now = time.time()
    inject_spot_prices(monkeypatch, [(t, f"{REGION}a", now - 7200, Decimal(p)) for t, p in
                                     (("g4dn.xlarge", "0.1578"), ("g5.xlarge", "0.3018"), ("c6i.xlarge", "0.0621"))])
    cfg = aws_config(moto_url, fleet, str(project.root), budget_per_hour="3.00", max_hosts=50)
    ctl = controller(cfg, aws_session, project, connect(redis_server.url))
    for k in range(40):
        boinc_db.unsent(unit_name("j", 1, k))
    rep = ctl.step()  # 40 unsent, 2 slots: 20 hosts wanted; $3/h at 0.3018 $/h buys 9
    assert rep.desired == 9 and any("budget $3.00/h buys 9 hosts at $0.3018/h" in x for x in rep.reasons)
    assert running_members(aws_session, moto_url, fleet["asg"]) == 9


def test_sizing_budget_and_fallback_back(aws_session, moto_url, boinc_db, project, redis_server, monkeypatch) -> None:
    fleet = make_fleet(aws_session, moto_url, 2)
    now = [time.time()]
    cfg = aws_config(moto_url, fleet, str(project.root), budget_per_hour="2.00", max_hosts=50, min_hosts=1)
    r = connect(redis_server.url)
    hist = [(t, f"{REGION}a", now[0] - 7200, Decimal(p)) for t, p in
            (("g4dn.xlarge", "0.1578"), ("g5.xlarge", "0.3018"), ("c6i.xlarge", "0.0621"))]
    hist.append(("g4dn.xlarge", f"{REGION}a", now[0] - 1800, Decimal("0.2104")))
    inject_spot_prices(monkeypatch, hist)
    ctl = controller(cfg, aws_session, project, r, clock=lambda: now[0])
    for k in range(40):
        boinc_db.unsent(unit_name("j", 1, k))
    rep = ctl.step()  # 40 unsent, 2 slots: 20 hosts wanted; g4dn at 0.2104 $/h: the budget buys 9
    assert ctl.book.price("g4dn.xlarge", f"{REGION}a", "spot", now[0]) == Decimal("0.2104")
    assert ctl.book.price("g4dn.xlarge", f"{REGION}a", "spot", now[0] - 3600) == Decimal("0.1578")
    assert rep.desired == 9 and any("budget" in x for x in rep.reasons)
    assert running_members(aws_session, moto_url, fleet["asg"]) == 9

    # the cloud refuses spot capacity: fallback; calm for hold_s: back (hysteresis)
    assert ctl.provider._refusals() == []
    demand = ctl.hosts.demand()
    d = decide(cfg, demand, 9, Decimal("0.2"), ctl.state.fallback(), 0,
               ["InsufficientInstanceCapacity: no Spot capacity"], now[0])
    assert d.shape.on_demand_percent == 50 and "refused" in d.reasons[0]
    now[0] += 300
    d = decide(cfg, demand, 9, Decimal("0.2"), d.fallback, 0, [], now[0])
    assert d.shape.on_demand_percent == 50 and d.fallback.active
    now[0] += 900
    back = decide(cfg, demand, 9, Decimal("0.2"), d.fallback, 0, [], now[0])
    assert back.shape.on_demand_percent == 0 and "calm" in back.reasons[0] and not back.fallback.active


def test_spot_market_is_read_from_instance_lifecycle(aws_session, moto_url) -> None:
    fleet = make_fleet(aws_session, moto_url, 0)
    ec2 = aws_session.client("ec2", endpoint_url=moto_url)
    out = ec2.run_instances(ImageId=AMI, MinCount=1, MaxCount=1, InstanceType="g5.xlarge",
                            InstanceMarketOptions={"MarketType": "spot"})
    iid = out["Instances"][0]["InstanceId"]
    p = AwsProvider(aws_config(moto_url, fleet, "/p").aws, aws_session)
    (inst,) = p._describe({iid: {}})
    assert inst.market == "spot" and inst.type == "g5.xlarge" and inst.state == "running"
    assert not inst.member  # not launched by the group
    (gone,) = p._describe({"i-00000000deadbeef0": {"InstanceType": "g5.xlarge"}})
    assert gone.state == "gone"
    assert p.describe(["i-00000000deadbeef0", "../etc"]) == []  # unknown to EC2, or not an id
    ec2_reclaim(aws_session, moto_url, [iid])
    (done,) = p.describe([iid])
    assert done.state == "gone" and done.reclaimed_by_cloud and abs(done.ended - time.time()) < 5


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
