"""The fleet control loop: re-issue early, replace reclaims, fall back, size, charge.

One :meth:`FleetController.step` per period (``period_s`` of fleet.yaml), and between
periods :meth:`FleetController.fast_path` every ``interrupt_poll_s``:

1. **Reclaims first** (the latency-critical part, :mod:`~boinc_dl.server.fleet.reclaims`):
   each warning or preemption of one of the fleet's instances, and each instance gone
   without one, has the results in progress on its BOINC host filed for re-issue now;
   then its record is marked, then the cloud forgets the warning.
2. **Cloud action**: a warned instance is drained (out of the group, so the group starts a
   replacement now; left to the cloud, which does not bill a spot instance it reclaims in
   its first hour) or terminated (``reclaim_action``); a preempted one is recreated.
3. **Fallback and size** (:func:`~boinc_dl.server.fleet.decide.decide`), from the durable
   fallback state and reclaim window; the budget applies from the first period (with
   nothing running, a new host is priced at the dearest type the group may launch).
4. **Cost**: every live instance is charged up to now, every ended one settled
   (:class:`~boinc_dl.server.fleet.cost.Ledger`).

Everything the controller knows lives in Redis (:class:`~boinc_dl.server.fleet.state.FleetState`),
keyed by the cloud's instance uid, and every change is one fenced, idempotent commit made
after the effect it records: a controller killed at any instruction and restarted
neither loses nor repeats an effect, and only the holder of the fleet's lease acts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from boinc_dl.server.fleet.boinchosts import BoincHosts
from boinc_dl.server.fleet.config import FleetConfig
from boinc_dl.server.fleet.cost import Ledger, job_shares, publish_summaries
from boinc_dl.server.fleet.decide import decide
from boinc_dl.server.fleet.prices import StepPriceBook, UnknownPrice
from boinc_dl.server.fleet.provider import FleetProvider, Instance, Interruption, Observation
from boinc_dl.server.fleet.reclaims import Reclaims
from boinc_dl.server.fleet.records import InstanceRecord, ms
from boinc_dl.server.fleet.state import Commit, FleetState, LeaseLost

log = logging.getLogger("boinc-dl.fleet")

#: A settled record is kept this long (a late duplicate warning still finds it handled).
RETAIN_S = 86400.0
ALIVE = ("pending", "running", "stopping")


@dataclass
class StepReport:
    """What one period did (also what ``fleet status`` shows)."""

    time: float
    running: int  # alive and not doomed
    draining: int  # alive but doomed (warned, left to the cloud)
    desired: int
    on_demand_percent: int
    reissued: list[str]
    replaced: list[str]
    decision_ms: float
    reasons: list[str]


class FleetController:
    """Drives one fleet (see module docstring)."""

    def __init__(self, cfg: FleetConfig, provider: FleetProvider, hosts: BoincHosts, state: FleetState,
                 book: StepPriceBook | None = None, clock: Callable[[], float] = time.time):
        self.cfg = cfg
        self.provider = provider
        self.hosts = hosts
        self.state = state
        self.clock = clock
        spot_flat = cfg.gcp.spot_prices if cfg.gcp else {}
        self.book = book or StepPriceBook(cfg.on_demand_prices, spot_flat)
        self.ledger = Ledger(self.book, provider.billing)
        self.reclaims = Reclaims(cfg, provider, hosts, state)
        self.created: float | None = None
        self.prices_until = clock() - (cfg.aws.spot_history_s if cfg.aws else 0.0)
        self.last: StepReport | None = None

    # ---- lease ------------------------------------------------------------------------------
    def hold(self) -> None:
        """Take or renew the fleet's lease, or raise :class:`LeaseLost`."""
        held, holder, left = self.state.hold(self.cfg.lease_s)
        if not held:
            raise LeaseLost(f"fleet {self.state.fleet}: held by {holder} for {left:.1f}s more")
        if self.created is None:
            self.created = self.state.ensure_created(self.clock(), self.provider.name)

    def _commit(self, c: Commit, now: float) -> None:
        self.state.commit(c, now - max(self.cfg.fallback.window_s, 3600.0))

    # ---- reclaims ---------------------------------------------------------------------------
    def _reclaim(self, events: list[Interruption], recs: dict[str, InstanceRecord], gone: list[str],
                 now: float) -> list[str]:
        """Mark ``events`` and the records of instances ``gone`` without a notice, file the
        units of every doomed life (again while it lasts), commit, then ack ``events``."""
        assert self.created is not None
        c = Commit()
        doomed, rebalanced = self.reclaims.mark(events, recs, ms(self.created), c, now)
        for uid in gone:
            rec = recs[uid]
            if not rec.doomed:
                rec.vanished = True
                c.records[uid] = rec
                log.info("%s %s (%s, %s) is gone without a notice", self.provider.name, rec.name, rec.type,
                         rec.zone)
        targets = {r.uid: r for r in recs.values() if r.doomed and r.settled_ms is None}
        # a reclaim learnt after its life was settled as gone still counts for its jobs
        targets.update({r.uid: r for r in [*doomed, *rebalanced]})
        jobs = FleetState.known_jobs(self.state.r)
        filed = self.reclaims.reissue(targets.values(), c, now, jobs) if targets else []
        self._commit(c, now)
        if events:
            self.provider.ack(events)
        return filed

    def _act(self, recs: dict[str, InstanceRecord], view: dict[str, Instance], now: float) -> list[str]:
        """The cloud actions decided for doomed instances and not yet done."""
        todo = [r for r in recs.values() if r.action and not r.action_done]
        if not todo:
            return []
        self.hold()  # a controller that lost the fleet must not touch the cloud
        done: list[str] = []
        drain = [r.uid for r in todo if r.action == "drain"]
        replace = [r.uid for r in todo if r.action == "replace"]
        if drain:
            done += self.provider.drain(drain)
        if replace:
            done += self.provider.replace(replace)
        c = Commit()
        for uid in done:
            rec = recs[uid]
            rec.action_done = True
            v = view.get(uid)
            if rec.action == "replace" and (v is None or v.state in ALIVE) and rec.end_ms is None:
                # stopped by its owner: billed as such (unless the cloud's own record of
                # its end says it reclaimed it first, which settling prefers)
                rec.terminated_ms = ms(now)
            c.records[uid] = rec
        self._commit(c, now)
        if done:
            log.info("%s %d doomed instance(s): %s", "draining / replacing", len(done), ", ".join(done[:5]))
        return done

    def fast_path(self) -> list[str]:
        """Between periods: renew the lease, handle new reclaims at once; the workunits filed."""
        self.hold()
        events = self.provider.poll_interruptions()
        if not events:
            return []
        now = self.clock()
        recs = self.state.records()
        filed = self._reclaim(events, recs, [], now)
        self._act(recs, {}, now)
        if filed:
            self.state.publish_status({}, len(filed))
        return filed

    # ---- prices -----------------------------------------------------------------------------
    def refresh_prices(self, types: list[str], now: float) -> None:
        try:
            points = self.provider.spot_prices(types, self.prices_until, now)
        except Exception as e:  # noqa: BLE001 - prices are best effort; the loop goes on
            log.warning("could not read spot prices: %s", e)
            return
        self.book.add_spot(points)
        self.prices_until = now

    def host_price(self, alive: list[InstanceRecord], candidates: list[tuple[str, str]], percent: int,
                   now: float) -> Decimal | None:
        """$/h of a host at the current mix: the mean over the live hosts; with none, the
        dearest of the (type, zone) the group may launch (the budget is a ceiling)."""
        spot, od = [], []
        for r in alive:
            try:
                spot.append(self.book.price(r.type, r.zone, "spot", now))
                od.append(self.book.price(r.type, r.zone, "on-demand", now))
            except UnknownPrice:
                continue
        p = Decimal(percent) / 100
        if spot:
            return (1 - p) * sum(spot) / len(spot) + p * sum(od) / len(od)
        priced = []
        for type_, zone in candidates:
            try:
                priced.append((1 - p) * self.book.price(type_, zone, "spot", now)
                              + p * self.book.price(type_, zone, "on-demand", now))
            except UnknownPrice:
                continue
        return max(priced) if priced else None

    # ---- the period -------------------------------------------------------------------------
    def _view(self, obs: Observation, recs: dict[str, InstanceRecord]) -> dict[str, Instance]:
        """The cloud's view of every instance the controller tracks: the group's members,
        and (described by uid) the unsettled ones that left it."""
        view = {i.uid: i for i in obs.instances}
        missing = sorted(u for u, r in recs.items() if r.settled_ms is None and u not in view)
        if missing:
            view.update({i.uid: i for i in self.provider.describe(missing)})
        return view

    def step(self) -> StepReport:
        """One control period (see module docstring)."""
        self.hold()
        assert self.created is not None
        now = self.clock()
        obs = self.provider.observe()
        recs = self.state.records()
        c = Commit()
        for inst in obs.instances:  # first sight: a record per life
            if inst.uid not in recs and inst.launched > 0:
                recs[inst.uid] = c.records[inst.uid] = InstanceRecord.first_seen(inst, ms(self.created), ms(now))
        self._commit(c, now)
        view = self._view(obs, recs)
        gone = [u for u, r in recs.items() if r.settled_ms is None and (u not in view or view[u].state == "gone")]
        filed = self._reclaim(obs.interruptions, recs, gone, now)
        replaced = self._act(recs, view, now)

        types = sorted({r.type for r in recs.values() if r.settled_ms is None} | {t for t, _ in obs.candidates})
        self.refresh_prices(types, now)
        t0 = time.perf_counter()
        alive = [r for u, r in recs.items() if r.settled_ms is None and u in view and view[u].state in ALIVE]
        window = self.state.reclaims_since(now - self.cfg.fallback.window_s)
        # The fleet as it was when the reclaims happened: replacements launched since do
        # not dilute the rate (nor does a fleet that shrank since inflate it).
        hosts = max((size for _, _, size in window), default=len(alive))
        demand = self.hosts.demand()
        fb = self.state.fallback()
        decision = decide(self.cfg, demand, hosts,
                          self.host_price([r for r in alive if not r.doomed], obs.candidates,
                                          obs.shape.on_demand_percent, now),
                          fb, len(window), obs.refusals, now)
        decision_ms = (time.perf_counter() - t0) * 1000
        if decision.fallback != fb:
            self._commit(Commit(fallback=decision.fallback), now)  # before the cloud hears of it
        for line in decision.reasons:
            log.info("%s", line)
        if decision.shape != obs.shape:
            log.info("fleet: %d -> %d hosts, %d%% on-demand (queue: %d unsent, %d running)",
                     obs.shape.desired, decision.shape.desired, decision.shape.on_demand_percent,
                     demand.unsent, demand.in_progress)
            self.hold()
            self.provider.apply(decision.shape)

        self.account(recs, view, now)
        running = sum(1 for r in alive if not r.doomed)
        self.last = StepReport(now, running, len(alive) - running, decision.shape.desired,
                               decision.shape.on_demand_percent, filed, replaced, decision_ms, decision.reasons)
        self.state.publish_status({
            "time": f"{now:.3f}", "provider": self.provider.name, "running": running,
            "draining": len(alive) - running, "desired": decision.shape.desired,
            "on_demand_percent": decision.shape.on_demand_percent,
            "fallback": decision.fallback.reason if decision.fallback.active else "",
            "fallback_since": f"{decision.fallback.since:.3f}" if decision.fallback.active else "",
            "last_trouble": f"{decision.fallback.last_trouble:.3f}",
            "reclaims_in_window": len(window), "reissued": len(filed), "replaced": len(replaced),
            "decision_ms": f"{decision_ms:.2f}", "last_reasons": " | ".join(decision.reasons),
            "owner": self.state.owner}, len(filed))
        return self.last

    def account(self, recs: dict[str, InstanceRecord], view: dict[str, Instance], now: float) -> None:
        """Charge every live instance up to ``now``; settle every ended one."""
        shares = job_shares(self.hosts.running_workunits(), FleetState.known_jobs(self.state.r))
        now_ms = ms(now)
        c = Commit()
        for uid, rec in sorted(recs.items()):
            if rec.settled_ms is not None:
                if now_ms - rec.settled_ms > RETAIN_S * 1000 and (rec.action_done or not rec.action):
                    c.records[uid] = None
                continue
            v = view.get(uid)
            if v is not None and v.state in ALIVE:
                rec.seen_ms = now_ms
                self.ledger.charge(rec, max(rec.charged_ms, now_ms), shares, c)
                c.records[uid] = rec
                continue
            end = self._end(rec, v, now_ms)
            by_cloud = v.reclaimed_by_cloud if v is not None and v.reclaimed_by_cloud is not None \
                else rec.reclaim_ms is not None and rec.terminated_ms is None
            if self.ledger.settle(rec, end, by_cloud, shares, c, now_ms):
                c.records[uid] = rec
        self._commit(c, now)
        touched = {j for j, _ in c.ledger}
        if touched:
            publish_summaries(self.state.r, self.state, touched)

    @staticmethod
    def _end(rec: InstanceRecord, v: Instance | None, now_ms: int) -> int:
        """When a gone instance stopped: the cloud's own record; else the end the cloud
        announced (a reclaim), or when the controller stopped it; else now (the first
        time it was seen gone, at most a period late)."""
        if v is not None and v.ended is not None:
            return ms(v.ended)
        if rec.terminated_ms is not None:
            return rec.terminated_ms
        if rec.reclaim_ends_ms is not None:
            return max(rec.reclaim_ends_ms, rec.seen_ms)
        return now_ms

    def run(self, stop: Any, max_periods: int | None = None) -> int:
        """Loop until ``stop`` (a threading.Event) is set: a period every ``period_s``,
        a look for reclaims every ``interrupt_poll_s`` in between; errors are logged and
        retried; while another controller holds the lease, wait for it."""
        n = 0
        log.info("fleet controller for %s fleet %s started (period %.0fs)", self.provider.name,
                 self.state.fleet, self.cfg.period_s)
        waiting = False
        try:
            while not stop.is_set():
                t = time.monotonic()
                try:
                    self.step()
                    if waiting:
                        log.info("took the fleet's lease: acting")
                        waiting = False
                    n += 1
                except LeaseLost as e:
                    if not waiting:
                        log.info("not acting: %s; waiting for the lease", e)
                        waiting = True
                    stop.wait(min(self.cfg.interrupt_poll_s, 1.0))
                    continue
                except Exception:  # noqa: BLE001 - a cloud or DB hiccup must not end the daemon
                    log.exception("control period failed; retrying next period")
                    n += 1
                if max_periods is not None and n >= max_periods:
                    break
                while not stop.wait(min(self.cfg.interrupt_poll_s,
                                        max(0.0, self.cfg.period_s - (time.monotonic() - t)))):
                    if time.monotonic() - t >= self.cfg.period_s:
                        break
                    try:
                        self.fast_path()
                    except LeaseLost:
                        break
                    except Exception:  # noqa: BLE001
                        log.exception("looking for reclaims failed; retrying")
        finally:
            try:
                self.state.release()
            except Exception:  # noqa: BLE001 - the lease lapses by itself
                log.warning("could not release the lease; it lapses in %.0fs", self.cfg.lease_s)
        log.info("fleet controller stopped")
        return 0
