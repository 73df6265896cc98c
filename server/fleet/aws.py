"""AWS: an auto scaling group with a mixed instances policy, and its interruption queue.

* size: ``SetDesiredCapacity``; the on-demand share: the policy's
  ``InstancesDistribution.OnDemandPercentageAboveBaseCapacity`` (the whole policy is
  sent back with only that changed, so the launch template and overrides stay);
* instances: the group's members, their EC2 state, market (``InstanceLifecycle``),
  launch time, addresses and DNS names;
* reclaims: EventBridge delivers ``EC2 Spot Instance Interruption Warning`` (two minutes
  ahead) and ``EC2 Instance Rebalance Recommendation`` events to an SQS queue; each
  message is parsed with bounds and deleted once read;
* replacement: ``TerminateInstanceInAutoScalingGroup`` without decrementing, so the
  group launches a replacement now rather than after its next health check;
* refusals: failed scaling activities whose message says capacity was not available;
* prices: ``DescribeSpotPriceHistory``.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from datetime import datetime, timezone
from decimal import Decimal, InvalidOperation
from typing import Any

from boinc_dl.server.fleet.config import AwsSettings
from boinc_dl.server.fleet.provider import (
    FleetShape,
    Instance,
    Interruption,
    Observation,
    PricePoint,
)

log = logging.getLogger("boinc-dl.fleet.aws")

WARNING = "EC2 Spot Instance Interruption Warning"
REBALANCE = "EC2 Instance Rebalance Recommendation"
INSTANCE_ID = re.compile(r"^i-[0-9a-f]{8,17}$")
MAX_EVENT_BYTES = 256 * 1024  # SQS's own message limit
SPOT_NOTICE_S = 120.0
MAX_MESSAGES_PER_PERIOD = 2000
CAPACITY_WORDS = ("InsufficientInstanceCapacity", "capacity-not-available", "SpotMaxPriceTooLow",
                  "MaxSpotInstanceCountExceeded", "no Spot capacity", "insufficient capacity")
STATES = {"pending": "pending", "running": "running", "stopping": "stopping", "stopped": "gone",
          "shutting-down": "gone", "terminated": "gone"}


def parse_event(body: str) -> Interruption | None:
    """An EventBridge event (directly, or wrapped by SNS) as an :class:`Interruption`;
    None for anything else or anything malformed."""
    if len(body) > MAX_EVENT_BYTES:
        return None
    try:
        ev = json.loads(body)
        if isinstance(ev, dict) and ev.get("Type") == "Notification" and isinstance(ev.get("Message"), str):
            ev = json.loads(ev["Message"])
    except (ValueError, RecursionError):
        return None
    if not isinstance(ev, dict) or ev.get("detail-type") not in (WARNING, REBALANCE):
        return None
    detail = ev.get("detail")
    iid = detail.get("instance-id") if isinstance(detail, dict) else None
    if not isinstance(iid, str) or not INSTANCE_ID.match(iid):
        return None
    try:
        t = datetime.fromisoformat(str(ev.get("time", "")).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
    warning = ev["detail-type"] == WARNING
    return Interruption(iid, "warning" if warning else "rebalance", t,
                        t + SPOT_NOTICE_S if warning else t, str(ev.get("id", ""))[:128])


class AwsProvider:
    """The :class:`~boinc_dl.server.fleet.provider.FleetProvider` of an AWS auto scaling group."""

    name = "aws"

    def __init__(self, settings: AwsSettings, session: Any = None):
        import boto3

        self.s = settings
        session = session or boto3.session.Session(region_name=settings.region)
        kw = {"endpoint_url": settings.endpoint_url} if settings.endpoint_url else {}
        from botocore.config import Config

        kw["config"] = Config(retries={"max_attempts": 3, "mode": "standard"})
        self.asg = session.client("autoscaling", **kw)
        self.ec2 = session.client("ec2", **kw)
        self.sqs = session.client("sqs", **kw)
        self._policy: dict[str, Any] | None = None
        self._max_size = 0
        self._activities_seen: set[str] = set()
        self._members: set[str] = set()

    # ---- reading ----------------------------------------------------------------------------
    def _group(self) -> dict[str, Any]:
        groups = self.asg.describe_auto_scaling_groups(AutoScalingGroupNames=[self.s.asg_name])["AutoScalingGroups"]
        if not groups:
            raise LookupError(f"auto scaling group {self.s.asg_name} does not exist")
        return groups[0]

    def observe(self) -> Observation:
        g = self._group()
        self._policy = g.get("MixedInstancesPolicy")
        self._max_size = int(g.get("MaxSize", 0))
        dist = (self._policy or {}).get("InstancesDistribution", {})
        percent = int(dist.get("OnDemandPercentageAboveBaseCapacity", 100 if self._policy is None else 0))
        members = {m["InstanceId"]: m for m in g.get("Instances", [])}
        self._members = set(members)
        instances = self._describe(members)
        return Observation(time=datetime.now(timezone.utc).timestamp(), instances=instances,
                           shape=FleetShape(int(g.get("DesiredCapacity", 0)), percent),
                           interruptions=self._drain_queue(), refusals=self._refusals())

    def _describe(self, members: dict[str, dict[str, Any]]) -> list[Instance]:
        out: list[Instance] = []
        ids = sorted(members)
        found: set[str] = set()
        for k in range(0, len(ids), 200):
            for page in self._pages(ids[k:k + 200]):
                for res in page.get("Reservations", []):
                    for i in res.get("Instances", []):
                        found.add(i["InstanceId"])
                        state = STATES.get(i.get("State", {}).get("Name", ""), "gone")
                        m = members.get(i["InstanceId"], {})
                        if m.get("LifecycleState", "InService").startswith("Terminat"):
                            state = "gone"
                        names = tuple(n for n in (i.get("PrivateDnsName", ""), i.get("PublicDnsName", "")) if n)
                        out.append(Instance(
                            id=i["InstanceId"], type=i.get("InstanceType", m.get("InstanceType", "")),
                            market="spot" if i.get("InstanceLifecycle") == "spot" else "on-demand",
                            zone=i.get("Placement", {}).get("AvailabilityZone", m.get("AvailabilityZone", "")),
                            state=state, launched=i["LaunchTime"].timestamp(),
                            private_ip=i.get("PrivateIpAddress", ""), public_ip=i.get("PublicIpAddress", ""),
                            names=names))
        for iid in set(ids) - found:  # a member EC2 no longer lists: gone
            m = members[iid]
            out.append(Instance(iid, m.get("InstanceType", ""), "on-demand", m.get("AvailabilityZone", ""),
                                "gone", 0.0))
        return out

    def poll_interruptions(self) -> list[Interruption]:
        return self._drain_queue()

    def _pages(self, ids: list[str]) -> Any:
        """describe_instances of ``ids``; by id (a direct lookup), or, when one of them is
        unknown to EC2 (the whole call fails then), by an instance-id filter."""
        from botocore.exceptions import ClientError

        pager = self.ec2.get_paginator("describe_instances")
        try:
            return list(pager.paginate(InstanceIds=ids))
        except ClientError as e:
            if "InvalidInstanceID" not in str(e):
                raise
            return list(pager.paginate(Filters=[{"Name": "instance-id", "Values": ids}]))

    def _drain_queue(self) -> list[Interruption]:
        events: list[Interruption] = []
        read = 0
        while read < MAX_MESSAGES_PER_PERIOD:
            msgs = self.sqs.receive_message(QueueUrl=self.s.queue_url, MaxNumberOfMessages=10,
                                            WaitTimeSeconds=0).get("Messages", [])
            if not msgs:
                break
            read += len(msgs)
            for m in msgs:
                ev = parse_event(m.get("Body", ""))
                if ev is None:
                    log.warning("ignoring a message of the interruption queue that is not an interruption event")
                else:
                    events.append(ev)
            self.sqs.delete_message_batch(QueueUrl=self.s.queue_url, Entries=[
                {"Id": str(n), "ReceiptHandle": m["ReceiptHandle"]} for n, m in enumerate(msgs)])
        return events

    def _refusals(self) -> list[str]:
        try:
            acts = self.asg.describe_scaling_activities(AutoScalingGroupName=self.s.asg_name,
                                                        MaxRecords=20).get("Activities", [])
        except Exception as e:  # noqa: BLE001 - a missing permission must not stop the loop
            log.warning("cannot read scaling activities: %s", e)
            return []
        out = []
        for a in acts:
            aid = a.get("ActivityId", "")
            if aid in self._activities_seen:
                continue
            self._activities_seen.add(aid)
            msg = str(a.get("StatusMessage", ""))[:300]
            if a.get("StatusCode") in ("Failed", "Cancelled") and any(w in msg for w in CAPACITY_WORDS):
                out.append(msg)
        return out

    # ---- acting -----------------------------------------------------------------------------
    def apply(self, shape: FleetShape) -> None:
        if self._policy is not None:
            dist = self._policy.get("InstancesDistribution", {})
            if int(dist.get("OnDemandPercentageAboveBaseCapacity", 0)) != shape.on_demand_percent:
                policy = copy.deepcopy(self._policy)
                spec = policy.get("LaunchTemplate", {}).get("LaunchTemplateSpecification", {})
                if "LaunchTemplateId" in spec:  # describe returns id and name; update takes one
                    spec.pop("LaunchTemplateName", None)
                policy.setdefault("InstancesDistribution", {})["OnDemandPercentageAboveBaseCapacity"] = \
                    shape.on_demand_percent
                self.asg.update_auto_scaling_group(AutoScalingGroupName=self.s.asg_name, MixedInstancesPolicy=policy)
                self._policy = policy
        desired = shape.desired
        if self._max_size and desired > self._max_size:
            log.warning("asked for %d hosts but the group's MaxSize is %d", desired, self._max_size)
            desired = self._max_size
        self.asg.set_desired_capacity(AutoScalingGroupName=self.s.asg_name, DesiredCapacity=desired,
                                      HonorCooldown=False)

    def replace(self, instance_ids: list[str]) -> list[str]:
        from botocore.exceptions import BotoCoreError, ClientError

        done = []
        # Members only: the group already replaced those EC2 terminated and dropped.
        for iid in [i for i in instance_ids if i in self._members]:
            try:
                self.asg.terminate_instance_in_auto_scaling_group(InstanceId=iid,
                                                                  ShouldDecrementDesiredCapacity=False)
                done.append(iid)
            except (ClientError, BotoCoreError) as e:  # replaced meanwhile / left the group
                log.info("replace %s: %s", iid, e)
        return done

    def spot_prices(self, types: list[str], start: float, end: float) -> list[PricePoint]:
        if not types:
            return []
        out = []
        pager = self.ec2.get_paginator("describe_spot_price_history")
        for page in pager.paginate(InstanceTypes=types, ProductDescriptions=["Linux/UNIX (Amazon VPC)"],
                                   StartTime=datetime.fromtimestamp(start, timezone.utc),
                                   EndTime=datetime.fromtimestamp(end, timezone.utc)):
            for p in page.get("SpotPriceHistory", []):
                try:
                    price = Decimal(p["SpotPrice"])
                except (InvalidOperation, KeyError):
                    continue
                out.append(PricePoint(p["InstanceType"], p.get("AvailabilityZone", ""),
                                      p["Timestamp"].timestamp(), price))
        return out
