"""The one interface the controller sees of a cloud: instances, size, reclaims, prices.

Implementations: :class:`boinc_dl.server.fleet.aws.AwsProvider` (an auto scaling group with a
mixed instances policy, an SQS queue fed by EventBridge) and
:class:`boinc_dl.server.fleet.gcp.GcpProvider` (a SPOT managed instance group, optionally an
on-demand one). Nothing cloud-specific lives outside those two modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Literal, Protocol

from boinc_dl.server.fleet.billing import BillingRules
from boinc_dl.server.planner.prices import (
    Market,  # one definition of the markets for fleet and planner
)

#: The states the controller distinguishes (each cloud's own are mapped onto these).
State = Literal["pending", "running", "stopping", "gone"]
#: ``warning``: the cloud will reclaim it (AWS: two minutes ahead); ``preempted``: it
#: was reclaimed; ``rebalance``: a risk signal only (AWS rebalance recommendation);
#: ``lost``: it disappeared without either (no notice, or scaled in by the group).
InterruptionKind = Literal["warning", "preempted", "rebalance", "lost"]


@dataclass
class Instance:
    """One VM of the fleet as the cloud reports it.

    ``uid`` is the cloud's identity of this VM, never reused (EC2 instance id; GCE
    instance ``id``); ``name`` is what its host calls itself (EC2: the instance id;
    GCE: the instance name, which a managed instance group gives again to the VM it
    recreates). The controller keys everything on ``uid``."""

    uid: str
    name: str
    type: str
    market: Market
    zone: str
    state: State
    launched: float  # epoch seconds
    private_ip: str = ""
    public_ip: str = ""
    #: names the BOINC client may report as its host's domain_name
    names: tuple[str, ...] = ()
    #: a member of the fleet's group (False: detached or dropped, still described by the cloud)
    member: bool = True
    #: when it stopped, by the cloud's own record (None: running, or the cloud does not say)
    ended: float | None = None
    #: whether the cloud itself reclaimed it, by its own record (None: it does not say)
    reclaimed_by_cloud: bool | None = None


@dataclass
class Interruption:
    """A reclaim warning or a preemption, as read from the cloud."""

    uid: str  # the instance's uid (see Instance)
    kind: InterruptionKind
    time: float  # when the cloud emitted it (epoch seconds)
    #: when the instance stops (AWS warnings: time + 120 s; preemptions: time)
    ends: float
    source_id: str = ""  # event / operation id
    #: handle for :meth:`FleetProvider.ack` (AWS: the SQS receipt handle; GCP: none)
    receipt: str = ""


@dataclass
class PricePoint:
    """A spot price in force from ``time`` on."""

    type: str
    zone: str
    time: float
    usd_per_hour: Decimal


@dataclass
class FleetShape:
    """What the controller asks for: a size and the share of it on on-demand."""

    desired: int
    on_demand_percent: int


@dataclass
class Observation:
    """One look at the fleet at ``time``."""

    time: float
    instances: list[Instance]
    shape: FleetShape
    interruptions: list[Interruption] = field(default_factory=list)
    #: why the cloud refused spot capacity since the last look (empty: it did not)
    refusals: list[str] = field(default_factory=list)
    #: (type, zone) the group may launch next: what a new host is priced at
    candidates: list[tuple[str, str]] = field(default_factory=list)


class FleetProvider(Protocol):
    """A cloud's fleet, as the controller drives it."""

    name: str
    #: how this cloud bills an instance's life (minimum, increment, reclaim waivers)
    billing: BillingRules

    def observe(self) -> Observation:
        """Instances of the group, current shape, interruptions not yet acknowledged,
        capacity refusals, and what a new host may be."""
        ...

    def poll_interruptions(self) -> list[Interruption]:
        """Interruptions not yet acknowledged (cheap: called every ``interrupt_poll_s``)."""
        ...

    def ack(self, events: list[Interruption]) -> None:
        """The controller has durably handled ``events``: the cloud may forget them."""
        ...

    def describe(self, uids: list[str]) -> list[Instance]:
        """Instances by uid, members of the group or not, as far as the cloud still
        reports them (a VM deleted long ago is absent)."""
        ...

    def apply(self, shape: FleetShape) -> None:
        """Ask the cloud for ``shape`` (only what changed)."""
        ...

    def drain(self, uids: list[str]) -> list[str]:
        """Take doomed instances out of the group so that it launches replacements now,
        and leave them running for the cloud to reclaim; those no longer members."""
        ...

    def replace(self, uids: list[str]) -> list[str]:
        """Stop doomed instances now and have the group replace them; those done (or no
        longer needing it)."""
        ...

    def spot_prices(self, types: list[str], start: float, end: float) -> list[PricePoint]:
        """Spot price changes of ``types`` between ``start`` and ``end`` (and the one in
        force at ``start``)."""
        ...
