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
    """One VM of the fleet as the cloud reports it."""

    id: str  # AWS instance id; GCP instance name
    type: str
    market: Market
    zone: str
    state: State
    launched: float  # epoch seconds
    private_ip: str = ""
    public_ip: str = ""
    #: names the BOINC client may report as its host's domain_name
    names: tuple[str, ...] = ()


@dataclass
class Interruption:
    """A reclaim warning or a preemption, as read from the cloud."""

    instance_id: str
    kind: InterruptionKind
    time: float  # when the cloud emitted it (epoch seconds)
    #: when the instance stops (AWS warnings: time + 120 s; preemptions: time)
    ends: float
    source_id: str = ""  # event / operation id, for de-duplication


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


class FleetProvider(Protocol):
    """A cloud's fleet, as the controller drives it."""

    name: str

    def observe(self) -> Observation:
        """Instances, current shape, new interruptions and capacity refusals."""
        ...

    def poll_interruptions(self) -> list[Interruption]:
        """New interruptions only (cheap: called every ``interrupt_poll_s`` between periods)."""
        ...

    def apply(self, shape: FleetShape) -> None:
        """Ask the cloud for ``shape`` (only what changed)."""
        ...

    def replace(self, instance_ids: list[str]) -> list[str]:
        """Have reclaimed instances replaced at once, keeping the size; those replaced."""
        ...

    def spot_prices(self, types: list[str], start: float, end: float) -> list[PricePoint]:
        """Spot price changes of ``types`` between ``start`` and ``end`` (and the one in
        force at ``start``)."""
        ...
