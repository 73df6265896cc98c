"""Fixtures of the fleet tests: moto in server mode, BOINC's database tables, a job.

AWS runs in moto's ``ThreadedMotoServer`` on 127.0.0.1 and a free port; the clients
are boto3's own, pointed at it with ``endpoint_url``. moto answers spot price history
with a placeholder price, so :func:`inject_spot_prices` replaces the answer of
``DescribeSpotPriceHistory`` (still served over HTTP) with a realistic history.

BOINC's database is not here: :func:`boinc_db` creates, in SQLite, the columns of
BOINC's ``host``, ``app``, ``workunit`` and ``result`` tables that the controller
reads (names and meanings as in BOINC's ``db/schema.sql``).
"""

from __future__ import annotations

import json
import socket
import sqlite3
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

import pytest

REGION = "us-east-1"
TYPES = ["g4dn.xlarge", "g5.xlarge", "c6i.xlarge"]
#: moto does not check image ids (DescribeImages would load its whole catalogue: slow)
AMI = "ami-0abcdef1234567890"

BOINC_SCHEMA = """
CREATE TABLE app (id INTEGER PRIMARY KEY, name VARCHAR(254) NOT NULL UNIQUE);
CREATE TABLE host (id INTEGER PRIMARY KEY, domain_name VARCHAR(254), last_ip_addr VARCHAR(256),
                   external_ip_addr VARCHAR(256), rpc_time DOUBLE);
CREATE TABLE workunit (id INTEGER PRIMARY KEY, appid INTEGER NOT NULL, name VARCHAR(254) NOT NULL UNIQUE);
CREATE TABLE result (id INTEGER PRIMARY KEY, appid INTEGER NOT NULL, workunitid INTEGER NOT NULL,
                     hostid INTEGER NOT NULL DEFAULT 0, name VARCHAR(254) NOT NULL UNIQUE,
                     server_state INTEGER NOT NULL, outcome INTEGER NOT NULL DEFAULT 0,
                     sent_time INTEGER NOT NULL DEFAULT 0, report_deadline INTEGER NOT NULL DEFAULT 0);
"""


class BoincDB:
    """The SQLite stand-in of BOINC's tables, with helpers that write rows as BOINC does."""

    def __init__(self, path: Path):
        self.conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self.conn.executescript(BOINC_SCHEMA)
        self.conn.execute("INSERT INTO app (id, name) VALUES (1, 'boincdl'), (2, 'example_app')")

    def add_host(self, domain_name: str, ip: str = "", external_ip: str = "") -> int:
        cur = self.conn.execute("INSERT INTO host (domain_name, last_ip_addr, external_ip_addr) VALUES (?, ?, ?)",
                                (domain_name, ip, external_ip))
        return int(cur.lastrowid)

    def add_workunit(self, name: str, app: int = 1) -> int:
        return int(self.conn.execute("INSERT INTO workunit (appid, name) VALUES (?, ?)", (app, name)).lastrowid)

    def send(self, wu_name: str, host_id: int, sent_time: float, app: int = 1, replica: int = 0) -> None:
        """The scheduler sent result ``<wu>_<replica>`` to a host (server_state 4)."""
        wu = self.conn.execute("SELECT id FROM workunit WHERE name = ?", (wu_name,)).fetchone()
        wu_id = wu[0] if wu else self.add_workunit(wu_name, app)
        self.conn.execute("INSERT INTO result (appid, workunitid, hostid, name, server_state, sent_time) "
                          "VALUES (?, ?, ?, ?, 4, ?)", (app, wu_id, host_id, f"{wu_name}_{replica}", int(sent_time)))

    def unsent(self, wu_name: str, app: int = 1) -> None:
        wu_id = self.add_workunit(wu_name, app)
        self.conn.execute("INSERT INTO result (appid, workunitid, name, server_state) VALUES (?, ?, ?, 2)",
                          (app, wu_id, f"{wu_name}_0"))


@pytest.fixture
def boinc_db(tmp_path):
    db = BoincDB(tmp_path / "boinc.sqlite")
    yield db
    db.conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def moto_url():
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    port = free_port()
    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    srv.start()
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


@pytest.fixture
def project(tmp_path):
    """The fake BOINC project of the BOINC tests (real layout, fake tools)."""
    from tests.boinc.conftest import make_project

    return make_project(tmp_path / "project")
