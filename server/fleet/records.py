"""What the controller remembers, as plain data: one record per instance life, and the
fallback's state. :mod:`boinc_dl.server.fleet.state` stores them in Redis (JSON); nothing
here talks to Redis.

Times are integer milliseconds since the epoch, so a record written and read back bills
exactly the same.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from boinc_dl.server.fleet.provider import Instance


def ms(t: float) -> int:
    """Epoch seconds as integer milliseconds (what clouds report)."""
    return round(t * 1000)


@dataclass
class InstanceRecord:
    """One instance life, keyed by the cloud's ``uid`` (never by a reusable name)."""

    uid: str
    name: str
    type: str
    market: str
    zone: str
    launched_ms: int
    #: charged from here (its launch, or the fleet's first watch if that came later) ...
    charged_from_ms: int
    #: ... up to here (to the ledger, or provisionally in ``pending``)
    charged_ms: int
    #: the last time the cloud reported it alive
    seen_ms: int
    private_ip: str = ""
    public_ip: str = ""
    names: list[str] = field(default_factory=list)
    #: the cloud's reclaim (warning or preemption): when, and the end it announced
    reclaim_ms: int | None = None
    reclaim_ends_ms: int | None = None
    #: gone without a notice (no warning or preemption; or scaled in by the group)
    vanished: bool = False
    #: a rebalance recommendation was seen (a risk signal, not a reclaim)
    rebalance_ms: int | None = None
    #: when the controller first filed its units for re-issue
    handled_ms: int | None = None
    #: the cloud action decided for it ("drain" | "terminate" | ""), and whether done
    action: str = ""
    action_done: bool = False
    #: when the controller terminated it (an owner's termination: billed as such)
    terminated_ms: int | None = None
    #: per job, the earliest send time of a result of that job it held when doomed
    lost_since: dict[str, int] = field(default_factory=dict)
    #: the jobs this life's reclaim was counted for (once each: an instance first known
    #: only as gone is counted when its warning or preemption comes after)
    reclaims_counted: list[str] = field(default_factory=list)
    #: per job, [ms, nano-dollars, on-demand nano-dollars] charged provisionally: the
    #: cloud may still waive them (AWS: a spot instance EC2 reclaims in its first hour)
    pending: dict[str, list[int]] = field(default_factory=dict)
    #: its end (once gone) and when the ledger settled its life
    end_ms: int | None = None
    settled_ms: int | None = None

    @classmethod
    def first_seen(cls, inst: Instance, charge_from_ms: int, now_ms: int) -> InstanceRecord:
        """A record for an instance seen for the first time; its time is charged from
        ``charge_from_ms`` (its launch, or the fleet's first watch if that is later)."""
        launched = ms(inst.launched)
        start = max(launched, charge_from_ms)
        return cls(uid=inst.uid, name=inst.name, type=inst.type, market=inst.market, zone=inst.zone,
                   launched_ms=launched, charged_from_ms=start, charged_ms=start, seen_ms=now_ms,
                   private_ip=inst.private_ip, public_ip=inst.public_ip, names=list(inst.names))

    @property
    def doomed(self) -> bool:
        """Reclaimed by the cloud, or gone without a notice: its units are lost."""
        return self.reclaim_ms is not None or self.vanished

    def as_instance(self) -> Instance:
        """The instance as the BOINC host matching needs it (names and addresses)."""
        return Instance(self.uid, self.name, self.type, self.market, self.zone, "gone",  # type: ignore[arg-type]
                        self.launched_ms / 1000, self.private_ip, self.public_ip, tuple(self.names))

    def dumps(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def loads(cls, raw: str | bytes) -> InstanceRecord:
        data: dict[str, Any] = json.loads(raw)
        if "reclaims_counted" not in data:  # written before the field: a reclaimed life's jobs were counted
            data["reclaims_counted"] = sorted(data.get("lost_since", {})) if data.get("reclaim_ms") is not None else []
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass
class FallbackState:
    """Whether the fleet currently leans on on-demand, since when and why."""

    active: bool = False
    since: float = 0.0
    last_trouble: float = 0.0
    reason: str = ""

    def dumps(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def loads(cls, raw: str | bytes | None) -> FallbackState:
        if not raw:
            return cls()
        data = json.loads(raw)
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
