"""GCP: a managed instance group of SPOT VMs and, for the fallback, an on-demand one.

* size: ``instanceGroupManagers.resize`` of each group (the on-demand share goes to the
  on-demand group; without one the fallback has nothing to shift to and says so);
* instances: ``listManagedInstances`` (status, current action, creation errors) and
  ``instances.list`` filtered to the groups' base instance names (machine type,
  creation time, addresses);
* identity: a VM's ``id`` (the group recreates a preempted VM under the same *name*
  with a new ``id``: each is a life of its own);
* reclaims: ``zoneOperations.list`` with ``operationType = "compute.instances.preempted"``
  (GCP gives the guest 30 s, which the operation does not precede: a preemption is
  reported when it happens); the operation's ``targetId`` names the life preempted;
* an instance's end: its ``lastStopTimestamp``;
* replacement: a preempted member is recreated by the group itself (asking as well would
  race with it: ``recreateInstances`` names a VM by its reused name); a running one
  (``reclaim_action: terminate``) with ``recreateInstances``, only while the member of
  that name is still the life asked for;
* refusals: managed instances still being created whose last attempt failed for
  want of capacity (``ZONE_RESOURCE_POOL_EXHAUSTED``...);
* prices: GCP publishes SPOT prices per machine type and changes them at most monthly
  with no history API: they come from fleet.yaml (``gcp.spot_prices``).
"""

from __future__ import annotations

import logging
import re
from datetime import datetime
from typing import Any

from boinc_dl.server.fleet.billing import BillingRules
from boinc_dl.server.fleet.config import GcpSettings
from boinc_dl.server.fleet.provider import (
    FleetShape,
    Instance,
    Interruption,
    Market,
    Observation,
    PricePoint,
)

log = logging.getLogger("boinc-dl.fleet.gcp")

PREEMPTED = "compute.instances.preempted"
CAPACITY_CODES = ("ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
                  "QUOTA_EXCEEDED", "RESOURCE_POOL_EXHAUSTED")
STATES = {"PROVISIONING": "pending", "STAGING": "pending", "RUNNING": "running", "STOPPING": "stopping",
          "SUSPENDING": "stopping", "REPAIRING": "pending", "TERMINATED": "gone", "STOPPED": "gone",
          "SUSPENDED": "gone"}
NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
UID = re.compile(r"^[0-9]{1,20}$")
#: Per second with a one-minute minimum; no waiver for preempted VMs.
BILLING = BillingRules(increment_ms=1000, minimum_ms=60_000, reclaim_waiver_ms=0)


def _ts(s: str) -> float:
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp() if s else 0.0


def _last(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


class GcpProvider:
    """The :class:`~boinc_dl.server.fleet.provider.FleetProvider` of GCP managed instance groups."""

    name = "gcp"
    billing = BILLING

    def __init__(self, settings: GcpSettings, credentials: Any = None):
        from google.cloud import compute_v1

        self.s = settings
        kw: dict[str, Any] = {"transport": "rest"}
        if credentials is not None:
            kw["credentials"] = credentials
        if settings.endpoint_url:
            kw["client_options"] = {"api_endpoint": settings.endpoint_url}
        self.compute = compute_v1
        self.igm = compute_v1.InstanceGroupManagersClient(**kw)
        self.instances = compute_v1.InstancesClient(**kw)
        self.ops = compute_v1.ZoneOperationsClient(**kw)
        self._seen_ops: dict[str, float] = {}
        self._sizes: dict[str, int] = {}

    def _groups(self) -> list[tuple[str, Market]]:
        g: list[tuple[str, Market]] = [(self.s.mig, "spot")]
        if self.s.on_demand_mig:
            g.append((self.s.on_demand_mig, "on-demand"))
        return g

    def _where(self, mig: str) -> dict[str, str]:
        return {"project": self.s.project, "zone": self.s.zone, "instance_group_manager": mig}

    # ---- reading ----------------------------------------------------------------------------
    def observe(self) -> Observation:
        instances, refusals = self._list()
        od = self._sizes.get(self.s.on_demand_mig or "", 0)
        total = sum(self._sizes.values())
        percent = round(100 * od / total) if total and self.s.on_demand_mig else 0
        candidates = [(self.s.machine_type, self.s.zone)]
        return Observation(time=0.0, instances=instances, shape=FleetShape(total, percent),
                           interruptions=self._preemptions(), refusals=refusals, candidates=candidates)

    def describe(self, uids: list[str]) -> list[Instance]:
        """The groups' VMs among ``uids`` (a deleted VM, e.g. a recreated life, is gone
        from the API and absent here)."""
        want = set(uids)
        return [i for i in self._list()[0] if i.uid in want]

    def _list(self) -> tuple[list[Instance], list[str]]:
        instances: list[Instance] = []
        refusals: list[str] = []
        for mig, market in self._groups():
            g = self.igm.get(**self._where(mig))
            self._sizes[mig] = int(g.target_size)
            managed = list(self.igm.list_managed_instances(**self._where(mig)))
            details = {i.name: i for i in self.instances.list(request=self.compute.ListInstancesRequest(
                project=self.s.project, zone=self.s.zone, filter=f'name eq "{re.escape(g.base_instance_name)}-.*"'))}
            for m in managed:
                name = _last(m.instance)
                d = details.get(name)
                state = STATES.get(m.instance_status or (d.status if d else ""), "pending")
                if m.current_action in ("CREATING", "RECREATING") and state == "gone":
                    state = "pending"
                errors = [e for e in m.last_attempt.errors.errors if e.code in CAPACITY_CODES] \
                    if m.current_action in ("CREATING", "RECREATING") else []
                refusals += [f"{e.code}: {e.message}"[:300] for e in errors]
                nic = d.network_interfaces[0] if d and d.network_interfaces else None
                nat = nic.access_configs[0].nat_i_p if nic and nic.access_configs else ""
                uid = str(d.id) if d and d.id else str(m.id or "")
                if not uid:  # being created: no identity yet
                    continue
                gone = state == "gone"
                inst = Instance(
                    uid=uid, name=name, type=_last(d.machine_type) if d else self.s.machine_type, market=market,
                    zone=self.s.zone, state=state, launched=_ts(d.creation_timestamp) if d else 0.0,
                    private_ip=nic.network_i_p if nic else "", public_ip=nat,
                    names=tuple(n for n in ((d.hostname if d else ""),) if n),
                    ended=_ts(d.last_stop_timestamp) or None if gone and d else None)
                instances.append(inst)
        return instances, refusals

    def poll_interruptions(self) -> list[Interruption]:
        return self._preemptions()

    def ack(self, events: list[Interruption]) -> None:
        """Nothing to do: operations stay listed; the controller's records dedupe them."""

    def _preemptions(self) -> list[Interruption]:
        out = []
        for op in self.ops.list(request=self.compute.ListZoneOperationsRequest(
                project=self.s.project, zone=self.s.zone, filter=f'operationType = "{PREEMPTED}"')):
            oid = str(op.id or op.name)
            if oid in self._seen_ops:
                continue
            uid = str(op.target_id or "")
            if not NAME.match(_last(op.target_link)) or not UID.match(uid):
                continue
            t = _ts(op.insert_time)
            self._seen_ops[oid] = t
            out.append(Interruption(uid, "preempted", t, t, oid))
        if len(self._seen_ops) > 10000:  # keep the newest ones
            keep = sorted(self._seen_ops.items(), key=lambda kv: kv[1])[-5000:]
            self._seen_ops = dict(keep)
        return out

    # ---- acting -----------------------------------------------------------------------------
    def apply(self, shape: FleetShape) -> None:
        od = round(shape.desired * shape.on_demand_percent / 100) if self.s.on_demand_mig else 0
        if shape.on_demand_percent and not self.s.on_demand_mig:
            log.warning("fallback wants %d%% on-demand but gcp.on_demand_mig is not set", shape.on_demand_percent)
        sizes = {self.s.mig: shape.desired - od}
        if self.s.on_demand_mig:
            sizes[self.s.on_demand_mig] = od
        for mig, size in sizes.items():
            if self._sizes.get(mig) != size:
                self.igm.resize(**self._where(mig), size=size)
                self._sizes[mig] = size

    def drain(self, uids: list[str]) -> list[str]:
        """A preempted VM has stopped already: the group recreates it by itself."""
        return self.replace(uids)

    def replace(self, uids: list[str]) -> list[str]:
        """Recreate the members that are still these lives and still running. A stopped
        (preempted) member is left to the group, which recreates it by itself: asking as
        well races with it, and a ``recreateInstances`` that lands after the group's own
        recreation would destroy the VM's next life (the call names a VM by its name)."""
        current = {i.uid: i for i in self._list()[0]}
        done = [u for u in uids if u not in current or current[u].state == "gone"]
        by_mig: dict[str, list[str]] = {}
        for u in uids:
            inst = current.get(u)
            if inst is not None and inst.state != "gone" and NAME.match(inst.name):
                mig = self.s.on_demand_mig if inst.market == "on-demand" and self.s.on_demand_mig else self.s.mig
                by_mig.setdefault(mig, []).append(inst.name)
                done.append(u)
        for mig, names in by_mig.items():
            urls = [f"projects/{self.s.project}/zones/{self.s.zone}/instances/{n}" for n in names]
            req = self.compute.InstanceGroupManagersRecreateInstancesRequest(instances=urls)
            self.igm.recreate_instances(**self._where(mig),
                                        instance_group_managers_recreate_instances_request_resource=req)
        return done

    def spot_prices(self, types: list[str], start: float, end: float) -> list[PricePoint]:
        return []  # fixed prices from fleet.yaml (see module docstring)
