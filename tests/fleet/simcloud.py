"""A simulated cloud for a day of billing: instance lives decided in advance, reported as
a provider reports them (a day cannot pass in moto). Used by the cost test and the bench.

Each life: launch time (milliseconds), an end (EC2 reclaims it two minutes after its
warning, or its owner scales it in) or none (running past the day), its type, zone and
market. The cloud lists live instances, and ended ones with their end and who ended
them (as EC2's ``StateTransitionReason``/``StateReason`` say) for an hour after.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from decimal import Decimal

from boinc_dl.server.fleet.aws import BILLING
from boinc_dl.server.fleet.prices import ON_DEMAND_TABLE
from boinc_dl.server.fleet.provider import (
    FleetShape,
    Instance,
    Interruption,
    Observation,
    PricePoint,
)

DAY0 = 1_795_000_000.0
PERIOD = 300
SPOT_TYPES = {"g4dn.xlarge": Decimal("0.526"), "g5.xlarge": Decimal("1.006")}
ZONES = ["us-east-1a", "us-east-1b"]


def simulated_day(rng: random.Random) -> tuple[list[PricePoint], list[dict]]:
    """Spot price histories (a change every 1-3 h, at millisecond times) and 60 instance
    lifetimes: 40% reclaimed (warning, then the end 120 s later; some within their first
    hour), 30% scaled in at a period boundary, the rest running past the end of the day."""
    points = []
    for t, od in SPOT_TYPES.items():
        for z in ZONES:
            at = DAY0 - 3600
            while at < DAY0 + 86400:
                points.append(PricePoint(t, z, at, (od * Decimal(rng.uniform(0.25, 0.45))).quantize(Decimal("0.0001"))))
                at = round(at + rng.uniform(3600, 3 * 3600), 3)
    lives = []
    for k in range(60):
        spot = k % 5 != 0
        type_ = rng.choice(sorted(SPOT_TYPES)) if spot else "c6i.xlarge"
        launch = DAY0 + rng.randint(0, 80_000_000) / 1000
        kind = rng.choices(["reclaim", "scale-in", "stays"], [4, 3, 3])[0] if spot else rng.choice(["scale-in", "stays"])
        life = {"id": f"i-{k:017x}", "type": type_, "zone": rng.choice(ZONES), "market": "spot" if spot else "on-demand",
                "launch": launch, "end": None, "warning": None, "by_cloud": False}
        if kind == "reclaim":
            life["warning"] = round(launch + rng.uniform(20, 30000), 3)  # a third within the first hour
            life["end"] = life["warning"] + 120
            life["by_cloud"] = True
        elif kind == "scale-in":
            first = (int((launch - DAY0) // PERIOD) + 3) * PERIOD + DAY0
            life["end"] = float(rng.randrange(int(first), int(DAY0 + 86400), PERIOD))
        lives.append(life)
    return points, lives


class SimCloud:
    """The :class:`~boinc_dl.server.fleet.provider.FleetProvider` of :func:`simulated_day`."""

    name = "sim"
    billing = BILLING

    def __init__(self, lives: list[dict], clock: Callable[[], float]):
        self.lives = {lf["id"]: lf for lf in lives}
        self.clock = clock
        self.acked: set[str] = set()

    def _inst(self, lf: dict, t: float) -> Instance:
        gone = lf["end"] is not None and lf["end"] <= t
        return Instance(lf["id"], lf["id"], lf["type"], lf["market"], lf["zone"], "gone" if gone else "running",
                        lf["launch"], ended=lf["end"] if gone else None,
                        reclaimed_by_cloud=lf["by_cloud"] if gone else None)

    def observe(self) -> Observation:
        t = self.clock()
        insts = [self._inst(lf, t) for lf in self.lives.values()
                 if lf["launch"] <= t and (lf["end"] is None or lf["end"] > t - 3600)]
        return Observation(t, insts, FleetShape(sum(i.state == "running" for i in insts), 0),
                           self.poll_interruptions())

    def poll_interruptions(self) -> list[Interruption]:
        t = self.clock()
        return [Interruption(lf["id"], "warning", lf["warning"], lf["warning"] + 120, receipt=lf["id"])
                for lf in self.lives.values()
                if lf["warning"] is not None and lf["warning"] <= t and lf["id"] not in self.acked]

    def ack(self, events: list[Interruption]) -> None:
        self.acked |= {e.receipt for e in events}

    def describe(self, uids: list[str]) -> list[Instance]:
        t = self.clock()
        return [self._inst(self.lives[u], t) for u in uids if u in self.lives and self.lives[u]["launch"] <= t]

    def apply(self, shape: FleetShape) -> None:
        """The lives are decided in advance: sizing has no effect here."""

    def drain(self, uids: list[str]) -> list[str]:
        return list(uids)

    def replace(self, uids: list[str]) -> list[str]:
        return list(uids)

    def spot_prices(self, types: list[str], start: float, end: float) -> list[PricePoint]:
        return []


def independent_ledger(points: list[PricePoint], lives: list[dict], day_end: float) -> dict[str, Decimal]:
    """Dollars per (type|market), the on-demand equivalent and the waived bills, from the
    lives alone, by AWS's rules written out here: per second (a second begun counts), 60 s
    at least; a spot instance EC2 reclaims within its first hour is not billed."""
    out: dict[str, Decimal] = {"_od": Decimal(0), "_waived": Decimal(0)}

    def integrate(life: dict, a_ms: int, b_ms: int, market: str) -> Decimal:
        if market == "on-demand":
            return ON_DEMAND_TABLE[life["type"]] * (b_ms - a_ms) / 3_600_000
        pts = sorted((round(p.time * 1000), p.usd_per_hour) for p in points
                     if p.type == life["type"] and p.zone == life["zone"])
        usd = Decimal(0)
        for i, (t_ms, price) in enumerate(pts):
            nxt = pts[i + 1][0] if i + 1 < len(pts) else 10**16
            lo, hi = max(t_ms, a_ms), min(nxt, b_ms)
            if hi > lo:
                usd += price * (hi - lo) / 3_600_000
        return usd

    for life in lives:
        a_ms = round(life["launch"] * 1000)
        if life["end"] is not None and life["end"] <= day_end:
            end_ms = round(life["end"] * 1000)
            b_ms = a_ms + max(60_000, math.ceil((end_ms - a_ms) / 1000) * 1000)
            waived = life["by_cloud"] and life["market"] == "spot" and end_ms - a_ms < 3_600_000
        else:
            end_ms = b_ms = round(day_end * 1000)
            waived = False
        usd = integrate(life, a_ms, b_ms, life["market"])
        key = f"{life['type']}|{life['market']}"
        out.setdefault(key, Decimal(0))
        if waived:
            out["_waived"] += usd
            out["_od"] += integrate(life, a_ms, end_ms, "on-demand")
        else:
            out[key] += usd
            out["_od"] += integrate(life, a_ms, b_ms, "on-demand")
    return out
