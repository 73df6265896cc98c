"""AWS: an auto scaling group with a mixed instances policy, and its interruption queue.

* size: ``SetDesiredCapacity``; the on-demand share: the policy's
  ``InstancesDistribution.OnDemandPercentageAboveBaseCapacity`` (the whole policy is
  sent back with only that changed, so the launch template and overrides stay);
* instances: the group's members, their EC2 state, market (``InstanceLifecycle``),
  launch time, addresses and DNS names;
* reclaims: EventBridge delivers ``EC2 Spot Instance Interruption Warning`` (two minutes
  ahead) and ``EC2 Instance Rebalance Recommendation`` events to an SQS queue; each
  message is parsed with bounds and deleted once read;
* drain (the default for a warned instance): ``DetachInstances`` without decrementing,
  so the group launches a replacement now while EC2 reclaims the detached instance
  itself: EC2 does not bill a spot instance it interrupts in its first hour, but bills
  one its owner terminates;
* replacement (``reclaim_action: terminate``): ``TerminateInstanceInAutoScalingGroup``
  without decrementing;
* an instance's end: the time in its ``StateTransitionReason`` (``User initiated
  (2026-01-02 03:04:05 GMT)``); whether EC2 reclaimed it: its ``StateReason`` code
  ``Server.SpotInstanceTermination``;
* acknowledging: a queue message is deleted only once the controller has handled it (it
  is received with a short visibility timeout, so a controller that died holding it
  sees it again on restart);
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

from boinc_dl.server.fleet.billing import BillingRules
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
#: Per second, 60 s minimum; a spot instance EC2 interrupts in its first hour is free.
BILLING = BillingRules(increment_ms=1000, minimum_ms=60_000, reclaim_waiver_ms=3_600_000)
#: How long a received, unacknowledged interruption message stays hidden from the next
#: receive: a restarted controller sees what its dead predecessor had received by then.
VISIBILITY_S = 10
SPOT_TERMINATION = "Server.SpotInstanceTermination"
ENDED_AT = re.compile(r"\((\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}) (?:GMT|UTC)\)")
ASG_TAG = "aws:autoscaling:groupName"
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


def ended_at(reason: str) -> float | None:
    """The time in an EC2 ``StateTransitionReason`` (``User initiated (... GMT)``)."""
    m = ENDED_AT.search(reason or "")
    if not m:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc).timestamp()


class AwsProvider:
    """The :class:`~boinc_dl.server.fleet.provider.FleetProvider` of an AWS auto scaling group."""

    name = "aws"
    billing = BILLING

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
        self._junk: list[str] = []

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
        overrides = (self._policy or {}).get("LaunchTemplate", {}).get("Overrides", [])
        candidates = [(o["InstanceType"], z) for o in overrides if o.get("InstanceType")
                      for z in g.get("AvailabilityZones", [])]
        return Observation(time=datetime.now(timezone.utc).timestamp(), instances=instances,
                           shape=FleetShape(int(g.get("DesiredCapacity", 0)), percent),
                           interruptions=self._receive(), refusals=self._refusals(), candidates=candidates)

    def describe(self, uids: list[str]) -> list[Instance]:
        """Instances by id, members of the group or not (``member``: still tagged with
        the group's name, or listed by it)."""
        return [i for i in self._describe({u: {} for u in uids if INSTANCE_ID.match(u)}, strict=False)
                if i.launched > 0]

    def _describe(self, members: dict[str, dict[str, Any]], strict: bool = True) -> list[Instance]:
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
                        tags = {t.get("Key"): t.get("Value") for t in i.get("Tags", [])}
                        code = (i.get("StateReason") or {}).get("Code")
                        out.append(Instance(
                            uid=i["InstanceId"], name=i["InstanceId"],
                            type=i.get("InstanceType", m.get("InstanceType", "")),
                            market="spot" if i.get("InstanceLifecycle") == "spot" else "on-demand",
                            zone=i.get("Placement", {}).get("AvailabilityZone", m.get("AvailabilityZone", "")),
                            state=state, launched=i["LaunchTime"].timestamp(),
                            private_ip=i.get("PrivateIpAddress", ""), public_ip=i.get("PublicIpAddress", ""),
                            names=names, member=i["InstanceId"] in self._members or tags.get(ASG_TAG) == self.s.asg_name,
                            ended=ended_at(i.get("StateTransitionReason", "")) if state == "gone" else None,
                            reclaimed_by_cloud=(code == SPOT_TERMINATION) if state == "gone" and code else None))
        if strict:
            for iid in set(ids) - found:  # a member EC2 no longer lists: gone
                m = members[iid]
                out.append(Instance(iid, iid, m.get("InstanceType", ""), "on-demand", m.get("AvailabilityZone", ""),
                                    "gone", 0.0))
        return out

    def poll_interruptions(self) -> list[Interruption]:
        return self._receive()

    def ack(self, events: list[Interruption]) -> None:
        """Delete the handled events' messages (and the malformed ones met on the way)."""
        handles = list(dict.fromkeys([e.receipt for e in events if e.receipt] + self._junk))
        self._junk = []
        for k in range(0, len(handles), 10):
            self.sqs.delete_message_batch(QueueUrl=self.s.queue_url, Entries=[
                {"Id": str(n), "ReceiptHandle": h} for n, h in enumerate(handles[k:k + 10])])

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

    def _receive(self) -> list[Interruption]:
        """Messages now visible in the queue, as events carrying their receipt handles
        (deleted by :meth:`ack` once handled; the malformed ones with the next ack)."""
        events: list[Interruption] = []
        read = 0
        while read < MAX_MESSAGES_PER_PERIOD:
            msgs = self.sqs.receive_message(QueueUrl=self.s.queue_url, MaxNumberOfMessages=10,
                                            VisibilityTimeout=VISIBILITY_S, WaitTimeSeconds=0).get("Messages", [])
            if not msgs:
                break
            read += len(msgs)
            for m in msgs:
                ev = parse_event(m.get("Body", ""))
                if ev is None:
                    log.warning("ignoring a message of the interruption queue that is not an interruption event")
                    self._junk.append(m["ReceiptHandle"])
                else:
                    ev.receipt = m["ReceiptHandle"]
                    events.append(ev)
        if self._junk and not events:
            self.ack([])
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

    def _current_members(self) -> set[str]:
        g = self._group()
        self._members = {m["InstanceId"] for m in g.get("Instances", [])
                         if not m.get("LifecycleState", "InService").startswith(("Terminat", "Detach"))}
        return self._members

    def drain(self, uids: list[str]) -> list[str]:
        """Detach from the group (a replacement launches now); EC2 reclaims them."""
        from botocore.exceptions import BotoCoreError, ClientError

        members = self._current_members()
        done = [u for u in uids if u not in members]  # detached already, or gone and dropped
        todo = [u for u in uids if u in members]
        for k in range(0, len(todo), 20):  # DetachInstances takes 20 ids per call
            batch = todo[k:k + 20]
            try:
                self.asg.detach_instances(AutoScalingGroupName=self.s.asg_name, InstanceIds=batch,
                                          ShouldDecrementDesiredCapacity=False)
                done += batch
            except (ClientError, BotoCoreError) as e:  # one left meanwhile: the rest one by one
                log.info("detach %s: %s", ", ".join(batch), e)
                for u in batch:
                    try:
                        self.asg.detach_instances(AutoScalingGroupName=self.s.asg_name, InstanceIds=[u],
                                                  ShouldDecrementDesiredCapacity=False)
                        done.append(u)
                    except (ClientError, BotoCoreError) as e2:
                        if u not in self._current_members():
                            done.append(u)
                        else:
                            log.warning("detach %s: %s", u, e2)
        self._members -= set(done)
        return done

    def replace(self, uids: list[str]) -> list[str]:
        """Terminate members now; the group launches replacements (no double launch:
        an instance no longer a member is done already)."""
        from botocore.exceptions import BotoCoreError, ClientError

        members = self._current_members()
        done = [u for u in uids if u not in members]
        for iid in [u for u in uids if u in members]:
            try:
                self.asg.terminate_instance_in_auto_scaling_group(InstanceId=iid,
                                                                  ShouldDecrementDesiredCapacity=False)
                done.append(iid)
            except (ClientError, BotoCoreError) as e:  # replaced meanwhile / left the group
                log.info("replace %s: %s", iid, e)
                if iid not in self._current_members():
                    done.append(iid)
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
