"""Cost accounting per job: what the fleet cost, what reclaims wasted, what spot saved.

Every control period each live instance is charged for the milliseconds since it was
last charged, at the prices in force (:func:`boinc_dl.server.fleet.prices.cost_between`),
split over the jobs by their results in progress at that moment (time with nothing in
flight goes to ``_unattributed``). Alongside, the same time at the on-demand list price:
the on-demand equivalent. When an instance's life ends, the ledger settles it by the
cloud's rules (:class:`~boinc_dl.server.fleet.billing.BillingRules`):

* the bill runs to the end rounded up to the cloud's increment, and at least its
  minimum (60 s): the difference is charged then (or refunded, never in practice);
* a spot instance inside the cloud's waiver window (AWS: its first hour) is charged
  *provisionally* (kept in its record, not in the ledger); if the cloud itself reclaims
  it in that window its bill is waived, otherwise the provisional charges enter the
  ledger once the window has passed or its life ends;
* a reclaim adds *lost* compute: from the oldest result it held (of this life) to its
  real end; in dollars, the part of its bill over that time (nothing if waived);
* with ``reclaim_action: drain`` the ledger keeps what draining saved against
  terminating on the warning: the first-hour bills the cloud waived that a termination
  would have made billable, less the notice time paid for older instances.

Amounts are integers (milliseconds, nano-dollars) in each fleet's ledger
(:class:`~boinc_dl.server.fleet.state.FleetState`); a job's report sums the fleets'.
"""

from __future__ import annotations

import logging
from collections import Counter
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

import redis

from boinc_dl.server.common.workunit import parse_unit_name
from boinc_dl.server.fleet.billing import BillingRules
from boinc_dl.server.fleet.prices import PriceBook, UnknownPrice, cost_between
from boinc_dl.server.fleet.records import InstanceRecord
from boinc_dl.server.fleet.state import Commit, FleetState, summary_key

__all__ = ["UNATTRIBUTED", "Ledger", "cost_report", "job_shares", "publish_summaries", "summary_key"]

log = logging.getLogger("boinc-dl.fleet")

UNATTRIBUTED = "_unattributed"
NANO = Decimal(10) ** 9
CENT = Decimal("0.01")


def _nanos(usd: Decimal) -> int:
    return int((usd * NANO).to_integral_value(ROUND_HALF_EVEN))


def _split(total: int, shares: dict[str, int]) -> dict[str, int]:
    """Split an integer amount by integer weights, exactly (remainder to the largest)."""
    weight = sum(shares.values())
    out = {j: total * w // weight for j, w in shares.items()}
    out[max(shares, key=lambda j: (shares[j], j))] += total - sum(out.values())
    return out


class Ledger:
    """Charges instance records and settles their lives into a :class:`Commit` (pure:
    no I/O; the controller commits)."""

    def __init__(self, book: PriceBook, rules: BillingRules):
        self.book = book
        self.rules = rules

    def _usd(self, rec: InstanceRecord, market: str, a_ms: int, b_ms: int) -> int:
        """Nano-dollars of ``rec``'s type at ``market`` over [a, b) (negative if b < a)."""
        if a_ms == b_ms:
            return 0
        lo, hi = min(a_ms, b_ms), max(a_ms, b_ms)
        n = _nanos(cost_between(self.book, rec.type, rec.zone, market, lo / 1000, hi / 1000))  # type: ignore[arg-type]
        return n if b_ms > a_ms else -n

    def charge(self, rec: InstanceRecord, to_ms: int, shares: dict[str, int], c: Commit) -> bool:
        """Charge ``rec`` from where it was last charged up to ``to_ms`` (provisionally
        while a waiver may still come); False if no price is known for it yet (its time
        stays uncharged until one is)."""
        if to_ms == rec.charged_ms:
            return True
        try:
            usd = self._usd(rec, rec.market, rec.charged_ms, to_ms)
            od = self._usd(rec, "on-demand", rec.charged_ms, to_ms)
        except UnknownPrice as e:
            log.warning("%s (%s): %s; its time is charged once a price is known", rec.uid, rec.type, e)
            return False
        shares = {j: n for j, n in shares.items() if n > 0} or {UNATTRIBUTED: 1}
        parts = _split(to_ms - rec.charged_ms, shares), _split(usd, shares), _split(od, shares)
        provisional = self.rules.provisional(rec.market, rec.launched_ms, to_ms)
        if not provisional:
            self._flush(rec, c)
        for job in shares:
            amounts = [parts[0][job], parts[1][job], parts[2][job]]
            if provisional:
                old = rec.pending.get(job, [0, 0, 0])
                rec.pending[job] = [x + y for x, y in zip(old, amounts, strict=True)]
            else:
                self._book(rec, job, amounts, c)
        rec.charged_ms = to_ms
        return True

    def _book(self, rec: InstanceRecord, job: str, amounts: list[int], c: Commit) -> None:
        line = f"{rec.type}|{rec.market}"
        c.ledger[(job, f"ms|{line}")] += amounts[0]
        c.ledger[(job, f"nusd|{line}")] += amounts[1]
        c.ledger[(job, "od_nusd")] += amounts[2]

    def _flush(self, rec: InstanceRecord, c: Commit) -> None:
        """Provisional charges become final (the waiver window has passed)."""
        for job, amounts in sorted(rec.pending.items()):
            self._book(rec, job, amounts, c)
        rec.pending = {}

    def settle(self, rec: InstanceRecord, end_ms: int, by_cloud: bool, shares: dict[str, int], c: Commit,
               now_ms: int) -> bool:
        """Close ``rec``'s life at ``end_ms`` by the cloud's rules (module docstring);
        ``by_cloud``: the cloud itself reclaimed it. False if a price is missing."""
        rules = self.rules
        # The clouds report ends to the second; the instance was seen running up to where
        # it was last charged, so its life lasted at least that long (a life cut to zero
        # by the rounding would otherwise refund time it ran).
        reported_end_ms, end_ms = end_ms, max(end_ms, rec.charged_ms)
        waived = rules.waived(rec.market, rec.launched_ms, end_ms, by_cloud)
        try:
            if waived:
                bill_end = rules.billed_end_ms(rec.launched_ms, end_ms)
                full = self._usd(rec, rec.market, rec.charged_from_ms, bill_end)
                # what terminating when its units were re-issued would have cost: billable then
                # (handled after its end: a termination then would have changed nothing)
                handled = min(rec.handled_ms if rec.handled_ms is not None else end_ms, end_ms)
                would = self._usd(rec, rec.market, rec.charged_from_ms, rules.billed_end_ms(rec.launched_ms, handled))
                tail_od = self._usd(rec, "on-demand", rec.charged_ms, end_ms)
            else:
                bill_end = rules.billed_end_ms(rec.launched_ms, end_ms)
                if not self.charge(rec, bill_end, shares, c) and bill_end != rec.charged_ms:
                    return False
                self._flush(rec, c)
            lost = {job: self._lost(rec, since, end_ms, waived) for job, since in sorted(rec.lost_since.items())}
            paid_notice = 0
            if not waived and rec.action == "drain" and rec.handled_ms is not None and rec.reclaim_ms is not None:
                # drained past its first hour: the notice time was paid (terminate would not have)
                handled = min(rec.handled_ms, end_ms)
                paid_notice = self._usd(rec, rec.market, rules.billed_end_ms(rec.launched_ms, handled),
                                        rules.billed_end_ms(rec.launched_ms, end_ms))
        except UnknownPrice as e:
            log.warning("%s (%s): %s; its life is settled once a price is known", rec.uid, rec.type, e)
            return False
        if waived:
            used = {job: p[0] for job, p in rec.pending.items()}
            od = {job: p[2] for job, p in rec.pending.items()}
            tail = {j: n for j, n in shares.items() if n > 0} or {UNATTRIBUTED: 1}
            for job, v in _split(max(0, end_ms - rec.charged_ms), tail).items():
                used[job] = used.get(job, 0) + v
            for job, v in _split(tail_od, tail).items():
                od[job] = od.get(job, 0) + v
            weights = {j: max(v, 1) for j, v in used.items()}
            for job in used:  # the hours were used and count; the bill is waived
                c.ledger[(job, f"ms|{rec.type}|{rec.market}")] += used[job]
                c.ledger[(job, "od_nusd")] += od[job]
            for job, v in _split(full, weights).items():
                c.ledger[(job, "waived_nusd")] += v
            top = max(weights, key=lambda j: (weights[j], j))
            c.ledger[(top, "waived_n")] += 1
            if rec.action == "drain":
                for job, v in _split(would, weights).items():
                    c.ledger[(job, "drain_saved_nusd")] += v
            rec.pending = {}
            rec.charged_ms = end_ms
        elif paid_notice:
            weights = {j: n for j, n in shares.items() if n > 0} or {UNATTRIBUTED: 1}
            for job, v in _split(paid_notice, weights).items():
                c.ledger[(job, "drain_saved_nusd")] -= v
        for job, (lost_ms, lost_nusd) in lost.items():
            c.ledger[(job, "lost_ms")] += lost_ms
            c.ledger[(job, "lost_nusd")] += lost_nusd
        rec.end_ms, rec.settled_ms = reported_end_ms, now_ms
        return True

    def _lost(self, rec: InstanceRecord, since_ms: int, end_ms: int, waived: bool) -> tuple[int, int]:
        start = max(since_ms, rec.charged_from_ms)
        if start >= end_ms:
            return 0, 0
        return end_ms - start, 0 if waived else self._usd(rec, rec.market, start, end_ms)


def job_shares(workunits: list[str], jobs: set[str]) -> dict[str, int]:
    """Results in flight per known job, from BOINC workunit names."""
    c: Counter[str] = Counter()
    for name in workunits:
        parsed = parse_unit_name(name)
        if parsed and parsed["job"] in jobs:
            c[parsed["job"]] += 1
    return dict(c)


def _job_totals(r: redis.Redis, job: str) -> tuple[dict[str, int], dict[str, int]]:
    """A job's ledger summed over every fleet (and the pre-fleet-ledger key), and its
    provisional charges in the fleets' records: [ms, nusd, od] sums."""
    raw: Counter[str] = Counter(FleetState.legacy_job_cost(r, job))
    pending: Counter[str] = Counter()
    for fleet in FleetState.fleets(r):
        st = FleetState(r, fleet)
        raw.update(st.job_ledger(job))
        for rec in st.records().values():
            if job in rec.pending:
                ms_, nusd, _ = rec.pending[job]
                pending["ms"] += ms_
                pending["nusd"] += nusd
    return dict(raw), dict(pending)


def cost_report(r: redis.Redis, job: str) -> dict[str, Any]:
    """A job's cost: lines by (type, market), totals, on-demand equivalent, saving, loss,
    reclaims, what the cloud waived and what draining saved, and what is provisional."""
    raw, pending = _job_totals(r, job)
    lines: list[dict[str, Any]] = []
    per: dict[tuple[str, str], Counter[str]] = {}
    for k, v in raw.items():
        parts = k.split("|")
        if len(parts) == 3:
            per.setdefault((parts[1], parts[2]), Counter())[parts[0]] += v
    for (type_, market), cnt in sorted(per.items()):
        lines.append({"type": type_, "market": market, "hours": Decimal(cnt["ms"]) / 3_600_000,
                      "usd": (Decimal(cnt["nusd"]) / NANO)})
    total = sum((ln["usd"] for ln in lines), Decimal(0))
    od = Decimal(raw.get("od_nusd", 0)) / NANO
    saving = od - total
    return {
        "job": job,
        "lines": lines,
        "instance_hours": sum((ln["hours"] for ln in lines), Decimal(0)).quantize(Decimal("0.001")),
        "total_usd": total.quantize(CENT),
        "total_nusd": sum(v for k, v in raw.items() if k.startswith("nusd|")),
        "on_demand_usd": od.quantize(CENT),
        "saving_usd": saving.quantize(CENT),
        "saving_pct": (saving / od * 100).quantize(Decimal("0.1")) if od else Decimal(0),
        "lost_hours": (Decimal(raw.get("lost_ms", 0)) / 3_600_000).quantize(Decimal("0.001")),
        "lost_usd": (Decimal(raw.get("lost_nusd", 0)) / NANO).quantize(CENT),
        "reclaims": raw.get("reclaims", 0),
        "waived_n": raw.get("waived_n", 0),
        "waived_usd": (Decimal(raw.get("waived_nusd", 0)) / NANO).quantize(CENT),
        "drain_saved_usd": (Decimal(raw.get("drain_saved_nusd", 0)) / NANO).quantize(CENT),
        "waived_nusd": raw.get("waived_nusd", 0),
        "provisional_nusd": pending.get("nusd", 0),
        "provisional_hours": (Decimal(pending.get("ms", 0)) / 3_600_000).quantize(Decimal("0.001")),
        "provisional_usd": (Decimal(pending.get("nusd", 0)) / NANO).quantize(CENT),
    }


def publish_summaries(r: redis.Redis, state: FleetState, jobs: set[str]) -> None:
    """Refresh the admin page's ``bdl:J:cost_summary`` of ``jobs`` from the ledgers."""
    for job in sorted(jobs):
        rep = cost_report(r, job)
        state.write_summary(job, {k: str(v) for k, v in rep.items() if k != "lines" and not k.endswith("_nusd")})
