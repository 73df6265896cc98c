"""Cost accounting per job: what the fleet cost, what reclaims wasted, what spot saved.

Every control period the controller charges each instance for the seconds since it
was last charged (from its launch the first time, up to its end once it is gone) at
the prices in force (:func:`boinc_dl.server.fleet.prices.cost_between`), and splits the charge
over the jobs by their results in progress at that moment (time with nothing in
flight goes to ``_unattributed``). Alongside, the same seconds at the on-demand list
price: the on-demand equivalent. A reclaim adds "lost" compute: the instance time
since the oldest result it held was sent, whose work is gone.

Redis: ``bdl:<job>:cost`` (hash of integers: milliseconds and nano-dollars, so sums
are exact) and ``bdl:<job>:cost_summary`` (the same in words and dollars, for the
admin page).
"""

from __future__ import annotations

from collections import Counter
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

import redis

from boinc_dl.server.assimilator.store import PREFIX, JobStore
from boinc_dl.server.fleet.prices import PriceBook, cost_between
from boinc_dl.server.fleet.provider import Instance

UNATTRIBUTED = "_unattributed"
NANO = Decimal(10) ** 9
CENT = Decimal("0.01")


def cost_key(job: str) -> str:
    return f"{PREFIX}:{job}:cost"


def summary_key(job: str) -> str:
    return f"{PREFIX}:{job}:cost_summary"


def _nanos(usd: Decimal) -> int:
    return int((usd * NANO).to_integral_value(ROUND_HALF_EVEN))


def _split(total: int, shares: dict[str, int]) -> dict[str, int]:
    """Split an integer amount by integer weights, exactly (remainder to the largest)."""
    weight = sum(shares.values())
    out = {j: total * w // weight for j, w in shares.items()}
    out[max(shares, key=lambda j: (shares[j], j))] += total - sum(out.values())
    return out


class CostLedger:
    """Charges instances and reclaims to jobs in Redis (see module docstring)."""

    def __init__(self, r: redis.Redis, book: PriceBook):
        self.r = r
        self.book = book
        self.touched: set[str] = set()
        self._incr: Counter[tuple[str, str]] = Counter()  # (key, field) -> amount, until publish

    def charge(self, inst: Instance, t0: float, t1: float, shares: dict[str, int]) -> None:
        """Charge ``inst`` for [t0, t1) to the jobs in ``shares`` (job -> results in flight)."""
        if t1 <= t0:
            return
        shares = {j: n for j, n in shares.items() if n > 0} or {UNATTRIBUTED: 1}
        usd = _nanos(cost_between(self.book, inst.type, inst.zone, inst.market, t0, t1))
        od = _nanos(cost_between(self.book, inst.type, inst.zone, "on-demand", t0, t1))
        ms = round(t1 * 1000) - round(t0 * 1000)
        cu, co, cm = _split(usd, shares), _split(od, shares), _split(ms, shares)
        for job in shares:
            k = cost_key(job)
            self._incr[(k, f"ms|{inst.type}|{inst.market}")] += cm[job]
            self._incr[(k, f"nusd|{inst.type}|{inst.market}")] += cu[job]
            self._incr[(k, "od_nusd")] += co[job]
        self.touched.update(shares)

    def reclaimed(self, inst: Instance, ends: float, lost_by_job: dict[str, float]) -> None:
        """A reclaim of ``inst`` at ``ends``; ``lost_by_job``: per job, the earliest time
        a result it lost was sent."""
        for job, since in lost_by_job.items():
            start = max(since, inst.launched)
            if start >= ends:
                continue
            k = cost_key(job)
            self._incr[(k, "lost_ms")] += round(ends * 1000) - round(start * 1000)
            self._incr[(k, "lost_nusd")] += _nanos(cost_between(self.book, inst.type, inst.zone, inst.market,
                                                                start, ends))
            self._incr[(k, "reclaims")] += 1
            self.touched.add(job)

    def publish(self) -> None:
        """Write the charges since the last call (one round trip) and refresh the
        summaries of the jobs concerned."""
        if self._incr:
            p = self.r.pipeline(transaction=False)
            for (k, f), v in self._incr.items():
                p.hincrby(k, f, v)
            p.execute()
            self._incr.clear()
        for job in sorted(self.touched):
            s = cost_report(self.r, job)
            flat = {k: str(v) for k, v in s.items() if k != "lines"}
            self.r.hset(summary_key(job), mapping=flat)
        self.touched.clear()


def cost_report(r: redis.Redis, job: str) -> dict[str, Any]:
    """A job's cost: lines by (type, market), totals, on-demand equivalent, saving, loss."""
    raw = {k.decode(): int(v) for k, v in r.hgetall(cost_key(job)).items()}
    lines: list[dict[str, Any]] = []
    per: dict[tuple[str, str], Counter[str]] = {}
    for k, v in raw.items():
        parts = k.split("|")
        if len(parts) == 3:
            per.setdefault((parts[1], parts[2]), Counter())[parts[0]] += v
    for (type_, market), c in sorted(per.items()):
        lines.append({"type": type_, "market": market, "hours": Decimal(c["ms"]) / 3_600_000,
                      "usd": (Decimal(c["nusd"]) / NANO)})
    total = sum((ln["usd"] for ln in lines), Decimal(0))
    od = Decimal(raw.get("od_nusd", 0)) / NANO
    saving = od - total
    return {
        "job": job,
        "lines": lines,
        "instance_hours": sum((ln["hours"] for ln in lines), Decimal(0)).quantize(Decimal("0.001")),
        "total_usd": total.quantize(CENT),
        "on_demand_usd": od.quantize(CENT),
        "saving_usd": saving.quantize(CENT),
        "saving_pct": (saving / od * 100).quantize(Decimal("0.1")) if od else Decimal(0),
        "lost_hours": (Decimal(raw.get("lost_ms", 0)) / 3_600_000).quantize(Decimal("0.001")),
        "lost_usd": (Decimal(raw.get("lost_nusd", 0)) / NANO).quantize(CENT),
        "reclaims": raw.get("reclaims", 0),
    }


def job_shares(workunits: list[str], jobs: set[str]) -> dict[str, int]:
    """Results in flight per known job, from BOINC workunit names."""
    from boinc_dl.server.common.workunit import parse_unit_name

    c: Counter[str] = Counter()
    for name in workunits:
        parsed = parse_unit_name(name)
        if parsed and parsed["job"] in jobs:
            c[parsed["job"]] += 1
    return dict(c)


def known_jobs(r: redis.Redis) -> set[str]:
    return set(JobStore.list_jobs(r))
