"""How one validated result is folded into the server weights: the rule, its staleness,
its base, and the clip radius that only trusted results feed.

The merge rule (:mod:`boinc_dl.server.assimilator.rules`) is chosen by the job spec:

* ``delta`` (the default): ``W_s <- W_s + lr * S(s) * scale * (W_c - W_b)``, the client's
  own progress from the weights it started from (``W_b``), damped by its staleness ``s``
  (``S(s) = (1 + s) ** -p``) so that results computed from one base add up to their mean,
  not their sum;
* ``search``: the same update with the step ``c`` in place of ``lr * S(s)``, chosen per
  result among ``delta``'s weight and 4, 16, 64 times it (at most 1) by the server's
  forward passes at its current weights (:mod:`boinc_dl.server.assimilator.stepsearch`);
* ``fedasync``: ``W_s <- W_s + (1 - a) * S(s) * (W_c - W_s)``;
* ``paper``: the VC-ASGD paper's ``W_s <- a*W_s + (1-a)*W_c``, kept to reproduce it.

MOP replaces a model's weights (its units never overlap): ``W_s <- W_c``, clipped too.

Per result, before any shard is touched (a re-run after a crash applies the shards
left with the same numbers, recorded in the merge record):

* the **staleness** ``s``: merges into the model since the unit's base version, both
  from the server's own records (never the result file's ``base_version``, which the
  host writes);
* the **base weights** ``W_b``: the unit's input weights file, which the work generator
  wrote and keeps;
* the **clip scale**: an update ``W_c - W_b`` longer than the clip radius is shortened to
  it. The radius is ``clip_factor`` times the median norm of *trusted* updates, frozen per
  epoch (:class:`~boinc_dl.server.assimilator.rules.TrustedRadius`). A result is trusted
  when the job system vouches for it: the local backend's hosts are the user's own; on
  BOINC, a result whose workunit was replicated and agreed with a replica from another
  host. A patient host cannot feed the radius with its own accepted results.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from boinc_dl.server.assimilator import rules
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.errors import WeightsFormatError
from boinc_dl.server.common.spec import JobSpec
from boinc_dl.server.common.weights import Fingerprint, read_weights
from boinc_dl.server.common.workunit import WEIGHTS_IN

log = logging.getLogger(__name__)

#: Name of the trusted statistic the clip radius is computed from (per model).
RADIUS = "update_norm"
#: The name every merge of this policy logs for a replay (:func:`rules.apply`).
REPLAYABLE = rules.PLANNED


def rule_for(spec: JobSpec, epoch: int, in_flight: int = 1) -> rules.MergeRule:
    """The merge rule of ``spec`` for a unit of ``epoch`` issued while ``in_flight`` units
    were in flight (the ``delta`` rule caps a result's weight at ``rules.CAP_SHARE / in_flight``)."""
    if spec.mode != "vcasgd":
        return rules.MergeRule("paper", 0.0)  # MOP: the unit's weights replace the model's
    v = spec.vcasgd
    stale = rules.Staleness("poly", p=v.staleness_power)
    # None: a spec not derived (a job's stored spec always is): delta, the rule then
    if v.merge_rule in ("delta", "search", None):  # search: delta's weight is its smallest candidate step
        return rules.MergeRule("delta", staleness=stale, server_lr=v.server_lr,
                               cap_in_flight=v.cap_by_in_flight).capped(in_flight)
    if v.merge_rule == "fedasync":
        return rules.MergeRule("fedasync", v.alpha_for(epoch), stale)
    return rules.MergeRule("paper", v.alpha_for(epoch))


def trusted_radius(store: JobStore, spec: JobSpec, model: str, epoch: int) -> float | None:
    """The clip radius in force for ``model`` in ``epoch`` (None: no trusted statistics
    yet, or clipping off). Frozen at its first computation: the first assimilator of an
    epoch to compute it stores it, every other one reads the stored value."""
    v = spec.validation
    if v.clip_factor is None:
        return None
    frozen = store.trusted_frozen(model, RADIUS, epoch)
    if frozen is not None:
        return frozen
    tr = rules.TrustedRadius(factor=v.clip_factor, min_samples=v.clip_min_trusted)
    tr.values = store.trusted_values(model, RADIUS, tr.window)
    r = tr.radius(epoch)
    if r is None:
        return None
    return store.freeze_trusted(model, RADIUS, epoch, r)


@dataclass
class MergePlan:
    """Everything a merge of one result needs, computed once before its first shard."""

    rule: rules.MergeRule
    staleness: int
    base_version: int | None
    base: np.ndarray | None
    base_path: str | None
    scale: float
    norm: float | None
    radius: float | None
    #: ``merge_rule: search``: the step the server's search chose (None: the rule's own weight)
    step: float | None = None
    #: ... and the ``delta`` weight its candidates were multiples of
    step_weight: float | None = None
    #: the window the unit was issued into (:func:`in_flight_of` its record)
    in_flight: int = 1

    def candidate_steps(self, cohort: int = 1) -> list[float]:
        """The steps the search chooses among: 0, this result's ``delta`` weight and its
        multiples, bounded by its ``cohort`` (units issued from its base version) next to
        the window it was issued into (:func:`rules.search_steps`)."""
        return rules.search_steps(self.rule.weight(self.staleness), cohort, self.in_flight)

    def params(self) -> dict[str, Any]:
        """What a replay needs to recompute this merge bit for bit (JSON)."""
        rule, scale = self.rule, self.scale
        if self.step is not None:  # the searched step in place of the rule's own weight
            rule, factor = rules.stepped(self.step)
            scale *= factor
        st = rule.staleness
        return {"rule": {"name": rule.name, "alpha": rule.alpha, "server_lr": rule.server_lr,
                         "staleness": {"kind": st.kind, "p": st.p, "a": st.a, "b": st.b},
                         "max_weight": rule.max_weight},
                "s": self.staleness, "scale": scale, "base": self.base_path if self.base is not None else None}

    def combine(self, wc: np.ndarray) -> Any:
        """The per-shard update ``combine(ws, slice)`` that :meth:`JobStore.merge` calls:
        the registered replayable rule, so that a replay computes the same bytes."""
        params = self.params()
        if self.base is not None and self.base_path:
            rules.remember_base(self.base_path, self.base)

        def combine(ws: np.ndarray, sl: slice) -> np.ndarray:
            return rules.apply(REPLAYABLE, ws, wc[sl], params, sl)
        return combine

    def record(self) -> dict[str, Any]:
        """The plan's numbers for the merge record (enough to replay the merge)."""
        out = {"merge_rule": self.rule.describe(), "staleness": self.staleness, "base_version": self.base_version,
               "clip_scale": self.scale, "update_norm": self.norm, "clip_radius": self.radius}
        if self.step is not None:
            times = f"{self.step / self.step_weight:.3g}x " if self.step_weight else ""  # 0x: step 0
            out.update(merge_rule=f"search(step {self.step:.4g} = {times}{self.rule.describe()})", step=self.step)
        return out


def base_of(info: dict[str, Any], attempt: int | None) -> tuple[int | None, str | None]:
    """(weights version, weights file) a unit's ``attempt`` was issued from: the job
    system names the attempt a result belongs to (a regenerated unit runs as
    ``<unit>_r<n>``); without one, the unit's current issue."""
    rec = (info.get("bases") or {}).get(str(attempt)) if attempt is not None else None
    if rec:
        return int(rec[0]), str(rec[1])
    v = info.get("weights_version")
    return (int(v) if v is not None else None), (info.get("files") or {}).get(WEIGHTS_IN)


#: Units in flight a record may claim: the server's own record, bounded all the same.
MAX_IN_FLIGHT = 1_000_000


def in_flight_of(info: dict[str, Any]) -> int:
    """Units in flight when the unit was issued (the generator's ``in_flight``), 1 for a
    unit recorded before it was kept (no cap: what such a unit's merge did then)."""
    try:
        k = int(info.get("in_flight") or 1)
    except (TypeError, ValueError):
        return 1
    return min(MAX_IN_FLIGHT, max(1, k))


def plan_merge(store: JobStore, spec: JobSpec, info: dict[str, Any], model: str, epoch: int,
               wc: np.ndarray, fp: Fingerprint, attempt: int | None = None) -> MergePlan:
    """The plan of merging ``wc``, a result of ``attempt`` of the unit recorded as ``info``."""
    in_flight = in_flight_of(info)
    rule = rule_for(spec, epoch, in_flight)
    base_version, base_path = base_of(info, attempt)
    now = store.version(model)
    staleness = max(0, now - (base_version if base_version is not None else now))
    radius = trusted_radius(store, spec, model, epoch)
    base = load_base(base_path, fp)
    if base is None and rule.needs_base:
        # The unit's base is gone (removed by hand): damp the result by its staleness with
        # a mix instead, which needs no base.
        log.warning("unit base weights missing (%s): mixing this result instead", base_path)
        rule = rules.MergeRule("fedasync", 0.0, rule.staleness, max_weight=rule.max_weight)
    norm = rules.update_norm(wc, base) if base is not None else None
    scale = rules.clip_scale(norm, radius) if norm is not None else 1.0
    return MergePlan(rule, staleness, base_version, base, base_path, scale, norm, radius, in_flight=in_flight)


def load_base(path: str | None, fp: Fingerprint) -> np.ndarray | None:
    """A unit's base weights (an input weights file the work generator wrote), or None."""
    if not path or not Path(path).is_file():
        return None
    try:
        return read_weights(path, fp).flat
    except (WeightsFormatError, OSError):
        return None


def update_distance(store: JobStore, info: dict[str, Any], attempt: int | None, model: str, wc: np.ndarray,
                    fp: Fingerprint) -> float:
    """``||W_c - W_b||`` of a result, for the hard cap ``max_update_norm``; against the
    server's current weights when the unit's base is gone."""
    base = load_base(base_of(info, attempt)[1], fp)
    return rules.update_norm(wc, base if base is not None else store.snapshot(model).flat)


def observe(store: JobStore, model: str, epoch: int, plan: MergePlan, trusted: bool) -> None:
    """After a merge: a trusted result's update norm joins the statistics of the radius."""
    if trusted and plan.norm is not None and math.isfinite(plan.norm):
        store.push_trusted_value(model, RADIUS, epoch, plan.norm, rules.TrustedRadius().window)
