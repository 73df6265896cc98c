"""The fleet control loop: size to the queue, replace reclaims, re-issue early, fall back.

One :meth:`FleetController.step` per period (``period_s`` of fleet.yaml):

1. **Interruptions first** (they are the latency-critical part): each reclaim warning
   or preemption of one of our instances is mapped to its BOINC host(s)
   (:class:`~boinc_dl.server.fleet.boinchosts.BoincHosts`), and the results in progress there are
   filed for re-issue now (:func:`~boinc_dl.server.fleet.reissue.request_reissue`); the work
   generator regenerates them on its next pass instead of waiting for the deadline.
   The doomed instance is replaced at once (the cloud keeps the group's size).
2. **Fallback**: while the cloud refuses spot capacity, or reclaims per running host
   over ``fallback.window_s`` exceed ``fallback.threshold``, ``on_demand_percent`` of
   the fleet runs on-demand; it shifts back once the rate is below
   ``threshold * calm_ratio`` and nothing happened for ``hold_s`` (hysteresis).
3. **Size**: ``ceil((unsent + in progress) / slots_per_host)`` hosts, within
   ``min_hosts``..``max_hosts`` and what ``budget_per_hour`` buys at current prices.
4. **Cost**: every instance is charged for the period at the prices in force
   (:class:`~boinc_dl.server.fleet.cost.CostLedger`).

Every decision is logged in words.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import redis

from boinc_dl.server.common.workunit import parse_unit_name
from boinc_dl.server.fleet.boinchosts import BoincHosts, QueueDemand
from boinc_dl.server.fleet.config import FleetConfig
from boinc_dl.server.fleet.cost import CostLedger, job_shares, known_jobs
from boinc_dl.server.fleet.prices import StepPriceBook, UnknownPrice
from boinc_dl.server.fleet.provider import (
    FleetProvider,
    FleetShape,
    Instance,
    Interruption,
    Observation,
)
from boinc_dl.server.fleet.reissue import request_reissue

log = logging.getLogger("boinc-dl.fleet")

RECLAIMS = ("warning", "preempted")


@dataclass
class FallbackState:
    """Whether the fleet currently leans on on-demand, and since when / why."""

    active: bool = False
    since: float = 0.0
    last_trouble: float = 0.0
    reason: str = ""


@dataclass
class Decision:
    """One period's sizing decision and the words explaining it."""

    shape: FleetShape
    wanted: int
    reasons: list[str] = field(default_factory=list)


def decide(cfg: FleetConfig, demand: QueueDemand, running: int, host_price: Decimal | None,
           fb: FallbackState, recent_reclaims: int, refusals: list[str], now: float) -> Decision:
    """The sizing and fallback decision of one period (pure: no I/O; updates ``fb``)."""
    f = cfg.fallback
    reasons: list[str] = []
    rate = recent_reclaims / max(running, 1)
    if refusals or rate > f.threshold:
        fb.last_trouble = now
        why = (f"the cloud refused spot capacity ({refusals[0]})" if refusals
               else f"{recent_reclaims} reclaims in {f.window_s:.0f}s over {running} hosts "
                    f"(rate {rate:.2f} > {f.threshold:.2f})")
        if not fb.active:
            fb.active, fb.since, fb.reason = True, now, why
            reasons.append(f"falling back to {f.on_demand_percent}% on-demand: {why}")
    elif fb.active and rate < f.threshold * f.calm_ratio and now - fb.last_trouble >= f.hold_s:
        reasons.append(f"spot is calm again (rate {rate:.2f}, nothing for {now - fb.last_trouble:.0f}s): "
                       f"back to {f.base_on_demand_percent}% on-demand")
        fb.active, fb.reason = False, ""
    percent = f.on_demand_percent if fb.active else f.base_on_demand_percent

    queued = demand.unsent + demand.in_progress
    wanted = math.ceil(queued / cfg.slots_per_host)
    desired = min(max(wanted, cfg.min_hosts), cfg.max_hosts)
    if desired != wanted:
        reasons.append(f"{queued} results queued or running want {wanted} hosts; kept within "
                       f"{cfg.min_hosts}..{cfg.max_hosts}")
    if cfg.budget_per_hour is not None and host_price is not None and host_price > 0:
        affordable = int(cfg.budget_per_hour / host_price)
        if affordable < desired:
            capped = max(affordable, cfg.min_hosts)
            reasons.append(f"budget ${cfg.budget_per_hour}/h buys {affordable} hosts at ${host_price:.4f}/h "
                           f"each: {capped} instead of {desired}")
            desired = capped
    return Decision(FleetShape(desired, percent), wanted, reasons)


@dataclass
class StepReport:
    """What one period did (also what ``fleet status`` shows)."""

    time: float
    running: int
    desired: int
    on_demand_percent: int
    reissued: list[str]
    replaced: list[str]
    decision_ms: float
    reasons: list[str]


class FleetController:
    """Drives one fleet (see module docstring)."""

    def __init__(self, cfg: FleetConfig, provider: FleetProvider, hosts: BoincHosts, r: redis.Redis,
                 book: StepPriceBook | None = None, clock: Callable[[], float] = time.time):
        self.cfg = cfg
        self.provider = provider
        self.hosts = hosts
        self.r = r
        self.clock = clock
        spot_flat = cfg.gcp.spot_prices if cfg.gcp else {}
        self.book = book or StepPriceBook(cfg.on_demand_prices, spot_flat)
        self.ledger = CostLedger(r, self.book)
        self.fallback = FallbackState()
        self.started = clock()
        self.known: dict[str, Instance] = {}
        self.charged: dict[str, float] = {}  # instance -> charged up to
        self.ends: dict[str, float] = {}  # instance -> when the cloud stops it
        self.reclaim_times: deque[float] = deque()
        self.handled: set[tuple[str, str]] = set()
        self.prices_until = self.started - (cfg.aws.spot_history_s if cfg.aws else 0.0)
        self.last: StepReport | None = None

    # ---- interruptions ----------------------------------------------------------------------
    def handle_interruptions(self, events: list[Interruption], now: float) -> tuple[list[str], list[str]]:
        """Re-issue the in-flight results of reclaimed hosts; which workunits were filed and
        which instances must be replaced."""
        doomed: list[Instance] = []
        for ev in events:
            inst = self.known.get(ev.instance_id)
            if inst is None:
                log.info("ignoring a %s for %s: not an instance of this fleet", ev.kind, ev.instance_id)
                continue
            if (ev.instance_id, ev.kind) in self.handled:
                continue
            self.handled.add((ev.instance_id, ev.kind))
            if ev.kind in (*RECLAIMS, "lost"):
                if any((ev.instance_id, k) in self.handled for k in (*RECLAIMS, "lost") if k != ev.kind):
                    continue  # warned earlier, now preempted or gone: already handled
                if ev.kind != "lost":  # only the cloud's reclaims count towards the fallback
                    self.reclaim_times.append(ev.time)
                self.ends[ev.instance_id] = min(self.ends.get(ev.instance_id, ev.ends), ev.ends)
                doomed.append(inst)
                if ev.kind == "lost":
                    log.info("%s %s (%s, %s) is gone without a notice", self.provider.name, inst.id, inst.type,
                             inst.zone)
                else:
                    log.info("%s %s (%s, %s) will be reclaimed at %s", self.provider.name, inst.id, inst.type,
                             inst.zone, time.strftime("%H:%M:%S", time.gmtime(ev.ends)))
            elif self.cfg.reissue_on_rebalance:
                doomed.append(inst)
                log.info("rebalance recommendation for %s: re-issuing its units as configured", inst.id)
            else:
                log.info("rebalance recommendation for %s: noted (its units stay until a warning)", inst.id)
        if not doomed:
            return [], []
        host_ids = self.hosts.hosts_of(doomed)
        by_host = {h: i for i, hs in host_ids.items() for h in hs}
        flights = self.hosts.in_flight(sorted(by_host))
        filed = request_reissue(self.r, [f.workunit for f in flights], now)
        for inst in doomed:
            if inst.id not in host_ids:
                log.warning("%s has no BOINC host (domain_name %s or its IPs): nothing to re-issue",
                            inst.id, inst.id)
        # compute lost: per job, the earliest send time of a result the instance held
        jobs = known_jobs(self.r)
        lost_of: dict[str, dict[str, float]] = {}
        for f in flights:  # one pass over the flights, not one per doomed instance
            parsed = parse_unit_name(f.workunit)
            if f.host_id in by_host and parsed and parsed["job"] in jobs:
                lost = lost_of.setdefault(by_host[f.host_id], {})
                lost[parsed["job"]] = min(lost.get(parsed["job"], f.sent_time), f.sent_time)
        for inst in doomed:
            self.ledger.reclaimed(inst, self.ends.get(inst.id, now), lost_of.get(inst.id, {}))
        self.ledger.publish()
        if filed:
            log.info("re-issuing %d unit(s) of %d reclaimed instance(s) now: %s", len(filed), len(doomed),
                     ", ".join(filed[:5]) + (" ..." if len(filed) > 5 else ""))
        return filed, [i.id for i in doomed if i.market == "spot" or i.id in self.ends]

    # ---- prices and cost -----------------------------------------------------------------------
    def refresh_prices(self, types: list[str], now: float) -> None:
        try:
            points = self.provider.spot_prices(types, self.prices_until, now)
        except Exception as e:  # noqa: BLE001 - prices are best effort; the loop goes on
            log.warning("could not read spot prices: %s", e)
            return
        self.book.add_spot(points)
        self.prices_until = now

    def host_price(self, instances: list[Instance], percent: int) -> Decimal | None:
        """Mean $/h of a host at the current mix (None if no price is known)."""
        now = self.clock()
        spot, od = [], []
        for i in instances:
            try:
                spot.append(self.book.price(i.type, i.zone, "spot", now))
                od.append(self.book.price(i.type, i.zone, "on-demand", now))
            except UnknownPrice:
                continue
        if not spot:
            return None
        p = Decimal(percent) / 100
        return (1 - p) * sum(spot) / len(spot) + p * sum(od) / len(od)

    def account(self, obs: Observation, now: float) -> None:
        """Charge every instance up to ``now`` (or its end)."""
        shares = job_shares(self.hosts.running_workunits(), known_jobs(self.r))
        seen = set()
        for inst in obs.instances:
            seen.add(inst.id)
            if inst.state == "gone" and inst.id not in self.known:
                continue
            self.known[inst.id] = inst
            start = self.charged.get(inst.id, max(inst.launched, self.started))
            end = min(now, self.ends.get(inst.id, now))
            if inst.state == "gone" and inst.id not in self.ends:
                end = now
            if end > start:
                self.ledger.charge(inst, start, end, shares)
            self.charged[inst.id] = max(start, end)
            if inst.state == "gone":
                self._forget(inst.id)
        for iid in [i for i in self.known if i not in seen]:  # left the group and the listing
            inst = self.known[iid]
            start = self.charged.get(iid, max(inst.launched, self.started))
            end = min(now, self.ends.get(iid, now))
            if end > start:
                self.ledger.charge(inst, start, end, shares)
            self._forget(iid)
        self.ledger.publish()

    def _forget(self, iid: str) -> None:
        self.known.pop(iid, None)
        self.charged.pop(iid, None)
        self.ends.pop(iid, None)

    # ---- the period ----------------------------------------------------------------------------
    def step(self) -> StepReport:
        """One control period (see module docstring)."""
        now = self.clock()
        obs = self.provider.observe()
        for inst in obs.instances:
            if inst.state != "gone" or inst.id in self.known:
                self.known[inst.id] = inst
        gone = [i.id for i in obs.instances if i.state == "gone"]
        # An instance gone without a notice (or scaled in) lost its results all the same.
        lost = [Interruption(g, "lost", now, now) for g in gone if g in self.known]
        filed, doomed = self.handle_interruptions(obs.interruptions + lost, now)
        to_replace = sorted(set(doomed) | set(gone))
        replaced = self.provider.replace(to_replace) if to_replace else []
        for iid in replaced:
            self.ends[iid] = min(self.ends.get(iid, now), now)
        if replaced:
            log.info("replacing %d reclaimed instance(s): %s", len(replaced), ", ".join(replaced[:5]))

        self.refresh_prices(sorted({i.type for i in obs.instances}), now)
        t0 = time.perf_counter()
        horizon = now - self.cfg.fallback.window_s
        while self.reclaim_times and self.reclaim_times[0] < horizon:
            self.reclaim_times.popleft()
        alive = [i for i in obs.instances if i.state in ("pending", "running") and i.id not in self.ends]
        demand = self.hosts.demand()
        decision = decide(self.cfg, demand, len(alive), self.host_price(alive, obs.shape.on_demand_percent),
                          self.fallback, len(self.reclaim_times), obs.refusals, now)
        decision_ms = (time.perf_counter() - t0) * 1000
        for line in decision.reasons:
            log.info("%s", line)
        if decision.shape != obs.shape:
            log.info("fleet: %d -> %d hosts, %d%% on-demand (queue: %d unsent, %d running)",
                     obs.shape.desired, decision.shape.desired, decision.shape.on_demand_percent,
                     demand.unsent, demand.in_progress)
            self.provider.apply(decision.shape)

        self.account(obs, now)
        self.last = StepReport(now, len(alive), decision.shape.desired, decision.shape.on_demand_percent,
                               filed, replaced, decision_ms, decision.reasons)
        self._publish_status(self.last)
        return self.last

    def _publish_status(self, rep: StepReport) -> None:
        self.r.hset(STATUS_KEY, mapping={
            "time": f"{rep.time:.3f}", "provider": self.provider.name, "running": rep.running,
            "desired": rep.desired, "on_demand_percent": rep.on_demand_percent,
            "fallback": self.fallback.reason or "", "reissued": len(rep.reissued),
            "replaced": len(rep.replaced), "decision_ms": f"{rep.decision_ms:.2f}",
            "last_reasons": " | ".join(rep.reasons)})
        if rep.reissued:
            self.r.hincrby(STATUS_KEY, "reissued_total", len(rep.reissued))

    def fast_path(self) -> list[str]:
        """Between periods: handle new reclaims at once (re-issue, replace); the filed
        workunits."""
        now = self.clock()
        events = self.provider.poll_interruptions()
        if not events:
            return []
        filed, doomed = self.handle_interruptions(events, now)
        replaced = self.provider.replace(doomed) if doomed else []
        for iid in replaced:
            self.ends[iid] = min(self.ends.get(iid, now), now)
        if filed:
            self.r.hincrby(STATUS_KEY, "reissued_total", len(filed))
        return filed

    def run(self, stop: Any, max_periods: int | None = None) -> int:
        """Loop until ``stop`` (a threading.Event) is set: a period every ``period_s``,
        a look for reclaims every ``interrupt_poll_s`` in between; errors are logged and
        retried."""
        n = 0
        log.info("fleet controller for %s started (period %.0fs)", self.provider.name, self.cfg.period_s)
        while not stop.is_set():
            t = time.monotonic()
            try:
                self.step()
            except Exception:  # noqa: BLE001 - a cloud or DB hiccup must not end the daemon
                log.exception("control period failed; retrying next period")
            n += 1
            if max_periods is not None and n >= max_periods:
                break
            while not stop.wait(min(self.cfg.interrupt_poll_s, max(0.0, self.cfg.period_s - (time.monotonic() - t)))):
                if time.monotonic() - t >= self.cfg.period_s:
                    break
                try:
                    self.fast_path()
                except Exception:  # noqa: BLE001
                    log.exception("looking for reclaims failed; retrying")
        log.info("fleet controller stopped")
        return 0


STATUS_KEY = "bdl:_fleet:status"
