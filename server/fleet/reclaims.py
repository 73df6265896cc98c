"""Reclaims: from a cloud's warning (or a VM gone without one) to units re-issued now.

For each doomed instance life (keyed by the cloud's uid):

1. its BOINC host(s) are found (:class:`~boinc_dl.server.fleet.boinchosts.BoincHosts`) and
   the results in progress there *sent during this life* are filed for re-issue
   (:meth:`FleetState.file_reissue <boinc_dl.server.fleet.state.FleetState.file_reissue>`,
   idempotent); this is repeated while the life lasts and once more when it has ended, so
   a result sent after the warning is not left to its deadline either;
2. then, and only then, its record is marked (reclaim time, counted once per instance;
   the cloud action decided for it; per job the oldest result lost). A crash between
   the two re-files the same names (a no-op) when the warning comes again: the cloud
   forgets a warning only once it is marked (:meth:`FleetProvider.ack`).

A rebalance recommendation is a risk signal, not a reclaim: it is noted, and with
``reissue_on_rebalance`` the instance's units are re-issued once; it never counts
towards the fallback's rate, and a warning that follows is the instance's one reclaim.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from boinc_dl.server.common.workunit import parse_unit_name
from boinc_dl.server.fleet.boinchosts import LIFE_SLACK_S, BoincHosts, InFlight
from boinc_dl.server.fleet.config import FleetConfig
from boinc_dl.server.fleet.provider import FleetProvider, Instance, Interruption
from boinc_dl.server.fleet.records import InstanceRecord, ms
from boinc_dl.server.fleet.state import Commit, FleetState

#: Clouds report launch times to the whole second (EC2, GCE).
LAUNCH_RESOLUTION_MS = 1000

log = logging.getLogger("boinc-dl.fleet")


class Reclaims:
    """Marks reclaims on instance records and files their units (module docstring)."""

    def __init__(self, cfg: FleetConfig, provider: FleetProvider, hosts: BoincHosts, state: FleetState):
        self.cfg = cfg
        self.provider = provider
        self.hosts = hosts
        self.state = state

    def mark(self, events: list[Interruption], recs: dict[str, InstanceRecord], charge_from_ms: int,
             c: Commit, now: float) -> tuple[list[InstanceRecord], list[InstanceRecord]]:
        """Apply ``events`` to ``recs`` (adding records of instances of this fleet not
        seen before) into ``c``: the records newly doomed, and those whose units a
        rebalance re-issues."""
        doomed: list[InstanceRecord] = []
        rebalanced: list[InstanceRecord] = []
        unknown = sorted({e.uid for e in events if e.uid not in recs})
        if unknown:
            for inst in self._describe(unknown):
                if inst.member and inst.launched > 0:
                    recs[inst.uid] = c.records[inst.uid] = InstanceRecord.first_seen(inst, charge_from_ms, ms(now))
        for ev in sorted(events, key=lambda e: e.time):
            rec = recs.get(ev.uid)
            if rec is None:
                log.info("ignoring a %s for %s: not an instance of this fleet", ev.kind, ev.uid)
                continue
            if ev.kind == "rebalance":
                if rec.rebalance_ms is None:
                    rec.rebalance_ms = ms(ev.time)
                    c.records[rec.uid] = rec
                    if self.cfg.reissue_on_rebalance and not rec.doomed:
                        rebalanced.append(rec)
                        log.info("rebalance recommendation for %s: re-issuing its units as configured", rec.uid)
                    else:
                        log.info("rebalance recommendation for %s: noted (its units stay until a warning)", rec.uid)
                continue
            if rec.reclaim_ms is not None:
                continue  # at-least-once delivery, or a warning then the preemption: handled
            rec.reclaim_ms, rec.reclaim_ends_ms = ms(ev.time), ms(ev.ends)
            # a warned instance is drained (or stopped now, as configured); a preempted one
            # is already stopped: the group recreates it
            rec.action = self.cfg.reclaim_action if ev.kind == "warning" else "replace"
            if rec.action == "terminate":
                rec.action = "replace"
            c.records[rec.uid] = rec
            # the fleet as it was then (the reclaimed included, later replacements not).
            # Clouds report launch times to the whole second: an instance whose reported
            # launch is within a second before the event may have started after it (a
            # replacement), so only those launched a full second earlier count; and no
            # reclaim comes before its own instance ran (an event stamped earlier is a
            # skewed clock), so it is taken as no earlier than that.
            at = max(ms(ev.time), rec.launched_ms + LAUNCH_RESOLUTION_MS)
            alive = sum(1 for r in recs.values()
                        if r.launched_ms + LAUNCH_RESOLUTION_MS <= at and (r.end_ms is None or r.end_ms > at))
            c.reclaims[rec.uid] = (ev.time, alive)
            doomed.append(rec)
            log.info("%s %s (%s, %s) %s at %s", self.provider.name, rec.name, rec.type, rec.zone,
                     "will be reclaimed" if ev.kind == "warning" else "was preempted",
                     time.strftime("%H:%M:%S", time.gmtime(ev.ends)))
        return doomed, rebalanced

    def _describe(self, uids: list[str]) -> list[Instance]:
        try:
            return self.provider.describe(uids)
        except Exception as e:  # noqa: BLE001 - an unknown id must not stop the reclaims of known ones
            log.warning("could not look up %s: %s", ", ".join(uids[:5]), e)
            return []

    def reissue(self, targets: Iterable[InstanceRecord], c: Commit, now: float, jobs: set[str]) -> list[str]:
        """File the in-flight results of ``targets`` (their lives' results only); record
        per job the oldest one lost (doomed targets); the names filed for the first time."""
        targets = list(targets)
        if not targets:
            return []
        host_ids = self.hosts.hosts_of([r.as_instance() for r in targets])
        all_hosts = sorted({h for hs in host_ids.values() for h in hs})
        flights = self.hosts.in_flight(all_hosts)
        by_job: dict[str, list[str]] = {}
        per_rec: dict[str, list[InFlight]] = {}
        for rec in targets:
            if rec.uid not in host_ids:
                if rec.handled_ms is None:
                    log.warning("%s has no BOINC host (domain_name %s or its IPs): nothing to re-issue",
                                rec.uid, rec.name)
                continue
            mine = set(host_ids[rec.uid])
            lo = rec.launched_ms / 1000
            hi = rec.end_ms / 1000 if rec.end_ms is not None else None
            # GCP gives a recreated VM its predecessor's name (and host name): one life's
            # results are those sent while it existed
            per_rec[rec.uid] = [f for f in flights if f.host_id in mine and f.sent_time >= lo - LIFE_SLACK_S
                                and (hi is None or f.sent_time <= hi + LIFE_SLACK_S)]
            for f in per_rec[rec.uid]:
                parsed = parse_unit_name(f.workunit)
                if parsed and parsed["job"] in jobs:  # a hostile host name cannot create keys
                    by_job.setdefault(parsed["job"], []).append(f.workunit)
        filed = self.state.file_reissue({j: sorted(set(ws)) for j, ws in by_job.items()}, now)
        for rec in targets:
            changed = False
            if rec.doomed:
                if rec.handled_ms is None:
                    rec.handled_ms, changed = ms(now), True
                for f in per_rec.get(rec.uid, []):
                    parsed = parse_unit_name(f.workunit)
                    if not parsed or parsed["job"] not in jobs:
                        continue
                    job, sent = parsed["job"], ms(f.sent_time)
                    if job not in rec.lost_since or sent < rec.lost_since[job]:
                        rec.lost_since[job] = sent
                        changed = True
                if rec.reclaim_ms is not None:
                    # once per instance and job, also when the reclaim is learnt only after
                    # the instance was handled as gone (its jobs are in lost_since by then)
                    for job in sorted(set(rec.lost_since) - set(rec.reclaims_counted)):
                        c.ledger[(job, "reclaims")] += 1
                        rec.reclaims_counted.append(job)
                        changed = True
            if changed:
                c.records[rec.uid] = rec
        if filed:
            log.info("re-issuing %d unit(s) of %d reclaimed instance(s) now: %s", len(filed), len(targets),
                     ", ".join(filed[:5]) + (" ..." if len(filed) > 5 else ""))
        return filed
