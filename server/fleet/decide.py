"""One period's decision, pure: the on-demand fallback (with its hold) and the size.

* **Fallback**: while the cloud refuses spot capacity, or the cloud's reclaims over
  ``fallback.window_s`` exceed ``fallback.threshold`` per host, ``on_demand_percent`` of
  the fleet runs on-demand; it shifts back once the rate is below ``threshold *
  calm_ratio`` and nothing happened for ``hold_s``. The rate's denominator is the fleet
  as it was when the reclaims happened (the hosts alive then, the reclaimed ones
  included), not the survivors.
* **Size**: ``ceil((unsent + in progress) / slots_per_host)`` hosts within
  ``min_hosts``..``max_hosts``, and what ``budget_per_hour`` buys at ``host_price`` (a
  budget never pushes below ``min_hosts``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from decimal import Decimal

from boinc_dl.server.fleet.boinchosts import QueueDemand
from boinc_dl.server.fleet.config import FleetConfig
from boinc_dl.server.fleet.provider import FleetShape
from boinc_dl.server.fleet.records import FallbackState


@dataclass
class Decision:
    """One period's sizing decision and the words explaining it."""

    shape: FleetShape
    wanted: int
    fallback: FallbackState
    reasons: list[str] = field(default_factory=list)


def decide(cfg: FleetConfig, demand: QueueDemand, hosts: int, host_price: Decimal | None, fb: FallbackState,
           recent_reclaims: int, refusals: list[str], now: float) -> Decision:
    """The sizing and fallback decision of one period; ``fb`` is not changed (the new
    state is in the decision). ``hosts``: the rate's denominator (module docstring)."""
    f = cfg.fallback
    fb = FallbackState(fb.active, fb.since, fb.last_trouble, fb.reason)
    reasons: list[str] = []
    rate = recent_reclaims / max(hosts, 1)
    if refusals or rate > f.threshold:
        fb.last_trouble = now
        why = (f"the cloud refused spot capacity ({refusals[0]})" if refusals
               else f"{recent_reclaims} reclaims in {f.window_s:.0f}s over {hosts} hosts "
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
    return Decision(FleetShape(desired, percent), wanted, fb, reasons)
