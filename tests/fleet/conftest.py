"""Fixtures of the fleet tests: moto in server mode, BOINC's database tables, a job.

AWS runs in moto's ``ThreadedMotoServer`` on 127.0.0.1 and a free port; the clients
are boto3's own, pointed at it with ``endpoint_url``. moto answers spot price history
with a placeholder price, so :func:`inject_spot_prices` replaces the answer of
``DescribeSpotPriceHistory`` (still served over HTTP) with a realistic history.

BOINC's database: :func:`boinc_db` creates, in a real MariaDB (127.0.0.1:3306; the
tests skip, saying why, without one), the columns of BOINC's ``app``, ``host``,
``workunit`` and ``result`` tables that the controller reads, and points the test's
project at it; the controller reads it through ``BoincDB`` as in production.

EC2's side of a reclaim is played by :func:`ec2_reclaim`: the instance is terminated
through the API and marked as EC2 marks an instance it interrupts.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from decimal import Decimal

import pytest

from tests.support.mariadb import MARIADB, point_project_at, session_database
from tests.support.net import free_port

REGION = "us-east-1"
TYPES = ["g4dn.xlarge", "g5.xlarge", "c6i.xlarge"]
#: moto does not check image ids (DescribeImages would load its whole catalogue: slow)
AMI = "ami-0abcdef1234567890"

#: The columns of BOINC's ``app``, ``host``, ``workunit`` and ``result`` tables that the
#: fleet reads (names and meanings as in BOINC's ``db/schema.sql``), in MariaDB.
BOINC_SCHEMA = (
    "CREATE TABLE app (id INTEGER NOT NULL PRIMARY KEY, name VARCHAR(254) NOT NULL UNIQUE)",
    """CREATE TABLE host (id INTEGER NOT NULL AUTO_INCREMENT PRIMARY KEY, create_time INTEGER NOT NULL DEFAULT 0,
       rpc_time INTEGER NOT NULL DEFAULT 0, userid INTEGER NOT NULL DEFAULT 0,
       domain_name VARCHAR(254) NOT NULL DEFAULT '',
       last_ip_addr VARCHAR(256) NOT NULL DEFAULT '', external_ip_addr VARCHAR(256) NOT NULL DEFAULT '',
       p_ncpus INTEGER NOT NULL DEFAULT 1, p_fpops DOUBLE NOT NULL DEFAULT 0)""",
    """CREATE TABLE workunit (id INTEGER NOT NULL AUTO_INCREMENT PRIMARY KEY, create_time INTEGER NOT NULL DEFAULT 0,
       appid INTEGER NOT NULL, name VARCHAR(254) NOT NULL UNIQUE, delay_bound INTEGER NOT NULL DEFAULT 3600,
       error_mask INTEGER NOT NULL DEFAULT 0, assimilate_state INTEGER NOT NULL DEFAULT 0,
       canonical_resultid INTEGER NOT NULL DEFAULT 0)""",
    """CREATE TABLE result (id INTEGER NOT NULL AUTO_INCREMENT PRIMARY KEY, create_time INTEGER NOT NULL DEFAULT 0,
       appid INTEGER NOT NULL, workunitid INTEGER NOT NULL, hostid INTEGER NOT NULL DEFAULT 0,
       userid INTEGER NOT NULL DEFAULT 0, name VARCHAR(254) NOT NULL UNIQUE, server_state INTEGER NOT NULL, outcome INTEGER NOT NULL DEFAULT 0,
       validate_state INTEGER NOT NULL DEFAULT 0, sent_time INTEGER NOT NULL DEFAULT 0,
       report_deadline INTEGER NOT NULL DEFAULT 0, received_time INTEGER NOT NULL DEFAULT 0,
       elapsed_time DOUBLE NOT NULL DEFAULT 0, flops_estimate DOUBLE NOT NULL DEFAULT 0,
       KEY (workunitid), KEY (hostid))""",
)
class FleetBoincDB:
    """BOINC's tables in a MariaDB database of their own, written as BOINC's scheduler
    writes them; :meth:`point` makes a project's config.xml name it, so the controller
    reads it through :class:`~boinc_dl.server.backends.boinc.boincdb.BoincDB`."""

    def __init__(self, name: str):
        import pymysql

        self.name = name
        self.conn = pymysql.connect(**MARIADB, database=name, autocommit=True, connect_timeout=5)
        with self.conn.cursor() as c:
            for t in ("result", "workunit", "host", "app"):
                c.execute(f"DROP TABLE IF EXISTS {t}")
            for ddl in BOINC_SCHEMA:
                c.execute(ddl)
            c.execute("INSERT INTO app (id, name) VALUES (1, 'boincdl'), (2, 'example_app')")

    def _exec(self, sql: str, args: tuple = ()) -> int:
        with self.conn.cursor() as c:
            c.execute(sql, args)
            return int(c.lastrowid or 0)

    def point(self, project) -> None:  # noqa: ANN001 - a BoincProject
        """Make ``project``'s config.xml name this database."""
        point_project_at(project, self.name)

    def add_host(self, domain_name: str, ip: str = "", external_ip: str = "") -> int:
        return self._exec("INSERT INTO host (domain_name, last_ip_addr, external_ip_addr) VALUES (%s, %s, %s)",
                          (domain_name, ip, external_ip))

    def add_workunit(self, name: str, app: int = 1) -> int:
        return self._exec("INSERT INTO workunit (appid, name) VALUES (%s, %s)", (app, name))

    def send(self, wu_name: str, host_id: int, sent_time: float, app: int = 1, replica: int = 0) -> None:
        """The scheduler sent result ``<wu>_<replica>`` to a host (server_state 4)."""
        with self.conn.cursor() as c:
            c.execute("SELECT id FROM workunit WHERE name = %s", (wu_name,))
            row = c.fetchone()
        wu_id = row[0] if row else self.add_workunit(wu_name, app)
        self._exec("INSERT INTO result (appid, workunitid, hostid, name, server_state, sent_time, report_deadline) "
                   "VALUES (%s, %s, %s, %s, 4, %s, %s)",
                   (app, wu_id, host_id, f"{wu_name}_{replica}", int(sent_time), int(sent_time) + 3600))

    def unsent(self, wu_name: str, app: int = 1) -> None:
        wu_id = self.add_workunit(wu_name, app)
        self._exec("INSERT INTO result (appid, workunitid, name, server_state) VALUES (%s, %s, %s, 2)",
                   (app, wu_id, f"{wu_name}_0"))

    def close(self) -> None:
        self.conn.close()


@pytest.fixture(scope="session")
def fleet_mariadb():
    """A database of this test session (dropped at the end)."""
    yield from session_database("bdl_fleet")


@pytest.fixture
def project(tmp_path):
    """The fake BOINC project of the BOINC tests (real layout, fake tools)."""
    from tests.boinc.conftest import make_project

    return make_project(tmp_path / "project")


@pytest.fixture
def boinc_db(fleet_mariadb, project):
    """BOINC's tables, fresh for each test, named by ``project``'s config.xml."""
    db = FleetBoincDB(fleet_mariadb)
    db.point(project)
    yield db
    db.close()


def boinc_hosts(project):  # noqa: ANN001, ANN201
    """The controller's view of BOINC's hosts, through BoincDB (read-only)."""
    from boinc_dl.server.fleet.boinchosts import BoincHosts

    return BoincHosts.from_project(project)


def launch_spot_as_the_policy_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """moto launches every instance of a group on-demand; AWS launches a mixed
    instances policy's share above ``OnDemandPercentageAboveBaseCapacity`` on spot
    (``InstanceLifecycle: spot``). Mark moto's new group instances so."""
    from moto.autoscaling.models import FakeAutoScalingGroup

    launch = FakeAutoScalingGroup.replace_autoscaling_group_instances

    def replace(self, count_needed, propagated_tags):  # noqa: ANN001, ANN202 - moto's signature
        before = {s.instance.id for s in self.instance_states}
        launch(self, count_needed, propagated_tags)
        dist = (self.mixed_instances_policy or {}).get("InstancesDistribution")
        if dist is None:
            return
        pct = int(dist.get("OnDemandPercentageAboveBaseCapacity", 100))
        states = [s for s in self.instance_states if s.instance._state.name != "terminated"]
        od = sum(1 for s in states if s.instance.id in before and s.instance.lifecycle != "spot")
        want_od = math.ceil(len(states) * pct / 100)
        for s in states:
            if s.instance.id not in before:
                if od < want_od:
                    od += 1
                else:
                    s.instance.lifecycle = "spot"

    monkeypatch.setattr(FakeAutoScalingGroup, "replace_autoscaling_group_instances", replace)


@pytest.fixture(scope="module")
def moto_url():
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    port = free_port()
    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    srv.start()
    with pytest.MonkeyPatch.context() as mp:
        launch_spot_as_the_policy_says(mp)
        yield f"http://127.0.0.1:{port}"
    srv.stop()


@pytest.fixture
def aws_session(moto_url, monkeypatch):
    import boto3
    import requests

    requests.post(f"{moto_url}/moto-api/reset", timeout=10)  # a fresh account per test
    for k, v in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                 ("AWS_DEFAULT_REGION", REGION)):
        monkeypatch.setenv(k, v)
    return boto3.session.Session(region_name=REGION)


def make_fleet(session, url: str, size: int, name: str = "bdl-spot") -> dict[str, str]:
    """What the Terraform spot-fleet module creates: a launch template, an auto scaling
    group with a mixed instances policy (price-capacity-optimized over several types),
    an SQS queue and an EventBridge rule sending spot interruption warnings and
    rebalance recommendations to it."""
    ec2 = session.client("ec2", endpoint_url=url)
    asg = session.client("autoscaling", endpoint_url=url)
    sqs = session.client("sqs", endpoint_url=url)
    events = session.client("events", endpoint_url=url)
    ami = AMI
    ec2.create_launch_template(LaunchTemplateName=f"{name}-lt",
                               LaunchTemplateData={"ImageId": ami, "InstanceType": TYPES[0]})
    asg.create_auto_scaling_group(
        AutoScalingGroupName=name, MinSize=0, MaxSize=2000, DesiredCapacity=size,
        AvailabilityZones=[f"{REGION}a"], CapacityRebalance=True,
        MixedInstancesPolicy={
            "LaunchTemplate": {"LaunchTemplateSpecification": {"LaunchTemplateName": f"{name}-lt", "Version": "$Latest"},
                               "Overrides": [{"InstanceType": t} for t in TYPES]},
            "InstancesDistribution": {"OnDemandBaseCapacity": 0, "OnDemandPercentageAboveBaseCapacity": 0,
                                      "SpotAllocationStrategy": "price-capacity-optimized"}})
    q = sqs.create_queue(QueueName=f"{name}-interruptions")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=q, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    events.put_rule(Name=f"{name}-interruptions", EventPattern=json.dumps({
        "source": ["aws.ec2"],
        "detail-type": ["EC2 Spot Instance Interruption Warning", "EC2 Instance Rebalance Recommendation"]}))
    events.put_targets(Rule=f"{name}-interruptions", Targets=[{"Id": "controller", "Arn": arn}])
    return {"asg": name, "queue": q}


def put_interruptions(session, url: str, items: list[tuple[str, str, float]]) -> None:
    """Emit EventBridge events as EC2 does: (instance id, kind 'warning'|'rebalance', time)."""
    events = session.client("events", endpoint_url=url)
    entries = []
    for iid, kind, t in items:
        dt = ("EC2 Spot Instance Interruption Warning" if kind == "warning"
              else "EC2 Instance Rebalance Recommendation")
        detail = {"instance-id": iid, "instance-action": "terminate"} if kind == "warning" else {"instance-id": iid}
        entries.append({"Source": "aws.ec2", "DetailType": dt, "Detail": json.dumps(detail),
                        "Time": datetime.fromtimestamp(t, timezone.utc),
                        "Resources": [f"arn:aws:ec2:{REGION}:123456789012:instance/{iid}"]})
    for k in range(0, len(entries), 10):  # PutEvents takes 10 entries per call
        out = events.put_events(Entries=entries[k:k + 10])
        assert out["FailedEntryCount"] == 0, out


def inject_spot_prices(monkeypatch, history: list[tuple[str, str, float, Decimal]]) -> None:
    """Serve ``history`` [(type, zone, time, $/h)] from moto's DescribeSpotPriceHistory,
    filtered by InstanceTypes/StartTime/EndTime like AWS (the price in force at StartTime
    included)."""
    from moto.core.responses import ActionResult
    from moto.ec2.responses.spot_instances import SpotInstances

    def parse(v: object) -> float | None:
        if not v:
            return None
        return datetime.fromisoformat(str(v).replace("Z", "+00:00")).timestamp()

    def describe(self):  # noqa: ANN001, ANN202 - moto's response method
        types = self._get_param("InstanceTypes", [])
        start, end = parse(self._get_param("StartTime")), parse(self._get_param("EndTime"))
        rows = []
        for (type_, zone) in {(h[0], h[1]) for h in history}:
            if types and type_ not in types:
                continue
            pts = sorted(h for h in history if h[0] == type_ and h[1] == zone)
            for i, (_, _, t, price) in enumerate(pts):
                nxt = pts[i + 1][2] if i + 1 < len(pts) else float("inf")
                if (end is None or t <= end) and (start is None or nxt > start):
                    rows.append({"InstanceType": type_, "ProductDescription": "Linux/UNIX (Amazon VPC)",
                                 "SpotPrice": str(price), "AvailabilityZone": zone,
                                 "Timestamp": datetime.fromtimestamp(t, timezone.utc).isoformat()})
        return ActionResult({"SpotPriceHistory": rows})

    monkeypatch.setattr(SpotInstances, "describe_spot_price_history", describe)


def moto_ec2():  # noqa: ANN201 - moto's EC2 backend of the test account (the server runs in this process)
    from moto.backends import get_backend

    return get_backend("ec2")["123456789012"][REGION]


def ec2_reclaim(session, url: str, ids: list[str]) -> None:
    """EC2 interrupts spot instances: terminated (through the API, so the group hears
    of it), with the state reason and transition reason EC2 gives an interruption."""
    from moto.ec2.models.instances import StateReason

    if not ids:
        return
    session.client("ec2", endpoint_url=url).terminate_instances(InstanceIds=ids)
    be = moto_ec2()
    for iid in ids:
        inst = be.get_instance(iid)
        inst.state_reason = StateReason("Server.SpotInstanceTermination: Spot instance termination",
                                        "Server.SpotInstanceTermination")
        inst._reason = inst._reason.replace("User initiated", "Service initiated")


def backdate_launch(ids: list[str], launched: dict[str, float]) -> None:
    """Instances that have run for a while: their launch time, as EC2 records it."""
    be = moto_ec2()
    for iid in ids:
        be.get_instance(iid).launch_time = datetime.fromtimestamp(int(launched[iid]), timezone.utc)


def ec2_lives(session, url: str, ids: list[str] | None = None) -> dict[str, dict]:
    """Every instance EC2 knows (of ``ids``), with its launch and end by EC2's own record:
    what an independent bill is computed from."""
    from boinc_dl.server.fleet.aws import ended_at

    ec2 = session.client("ec2", endpoint_url=url)
    pages = ec2.get_paginator("describe_instances").paginate(**({"InstanceIds": ids} if ids else {}))
    out = {}
    for page in pages:
        for res in page["Reservations"]:
            for i in res["Instances"]:
                gone = i["State"]["Name"] in ("terminated", "shutting-down", "stopped")
                out[i["InstanceId"]] = {
                    "type": i["InstanceType"], "zone": i["Placement"]["AvailabilityZone"],
                    "market": "spot" if i.get("InstanceLifecycle") == "spot" else "on-demand",
                    "launch": i["LaunchTime"].timestamp(),
                    "end": ended_at(i.get("StateTransitionReason", "")) if gone else None,
                    "by_ec2": (i.get("StateReason") or {}).get("Code") == "Server.SpotInstanceTermination"}
    return out
