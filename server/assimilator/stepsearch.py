"""The step search of ``merge_rule: search``: the assimilator's side.

With many units in flight, the ``delta`` rule weighs each result about ``1/k`` (its base
is about ``k`` merges old): safe, but a round of results from one base then moves the
server by about the mean of their updates, where one unit in flight would have applied
them one after the other. The search gives each result the step that helps the server
weights *as they are now*: among ``delta``'s weight ``w`` and ``4w``, ``16w``, ``64w`` (each
at most 1: a result never moves the server further than its own update,
:func:`~boinc_dl.server.assimilator.rules.search_steps`), the one after which the loss of
a fixed sample of the training data (``vcasgd.search_batch`` examples) at the server's
current weights is lowest (ties: the smaller step). Measured in docs/merge-rules.md ("The
step search"): the first epoch with 128 to 1,000 units in flight comes out near one unit
in flight's, where ``delta`` lost 20-60 points.

The forward passes need TensorFlow, which no assimilator imports: the checker of the
held-out loss check does them (:mod:`boinc_dl.server.work_generator.losscheck`, a thread of
the work generator: BOINC's daemon, or ``boinc-dl run``'s process), through the same
request queue and verdicts (:func:`boinc_dl.server.assimilator.losscheck.ask`; a request of
kind ``step``). The chosen step is a verdict: the first one set wins, so every delivery of
a result, and a re-run of its merge after a crash, applies the same step; the merge
record names it and the merge log replays it (:meth:`MergePlan.params
<boinc_dl.server.assimilator.policy.MergePlan.params>`: ``delta`` with the step as its
rate, no other weight).

A result is searched after the loss check passed it (a refused result needs no step),
even with one unit in flight (``w = 1``: 0 or 1). A result whose base weights are gone is mixed as under ``delta`` (no step to search).
No verdict within ``vcasgd.search_wait_s`` (a checker starting or stopped), or a queue
the checker would not get through in that time at its recent pace (it publishes its
seconds per search), makes the result merge with ``delta``'s own weight, recorded as its
verdict (first writer wins, so a late answer of the checker changes nothing): the
search uses what checker capacity there is and never holds merges back for long.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from boinc_dl.server.assimilator import losscheck as lc
from boinc_dl.server.assimilator import rules
from boinc_dl.server.assimilator.policy import MergePlan
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.errors import ResultRejected
from boinc_dl.server.common.paths import confined, is_safe_name
from boinc_dl.server.common.spec import JobSpec

#: Requests of the step search are named apart from the loss check's (one result may have both).
PREFIX = "step-"


def enabled(spec: JobSpec) -> bool:
    """Whether ``spec``'s results get a searched step (VC-ASGD with ``merge_rule: search``)."""
    return spec.mode == "vcasgd" and spec.vcasgd.merge_rule == "search"


def step_id(unit: str, attempt: int | None, result: str) -> str:
    """The identity of one result's step search (a re-delivery maps to the same id)."""
    return PREFIX + lc.request_id(unit, attempt, result)


def accepted_step(verdict: dict[str, Any], fallback: float) -> tuple[float, float]:
    """The step (and the weight its candidates were multiples of) a verdict holds, taken only
    when it is one of the verdict's own candidates, all of them in (0, 1]; anything else
    (a verdict written by something other than the checker) gives ``fallback``, the
    result's ``delta`` weight: the search can only ever give a result a step it offered."""
    steps, step = verdict.get("steps"), verdict.get("step")
    ok = (isinstance(steps, list) and 0 < len(steps) <= rules.MAX_SEARCH_STEPS
          and all(isinstance(s, int | float) and not isinstance(s, bool) and math.isfinite(s) and 0.0 <= s <= 1.0
                  for s in steps)
          and any(s > 0 for s in steps)
          and isinstance(step, int | float) and not isinstance(step, bool) and step in steps)
    if not ok:
        return fallback, fallback
    return float(step), float(min(s for s in steps if s > 0))  # type: ignore[union-attr]


def _fall_back(store: JobStore, rid: str, steps: list[float], weight: float, why: str) -> dict[str, Any]:
    """No search in time (a checker starting, stopped, or behind): the result merges with
    delta's own weight, recorded as its verdict, once (a verdict the checker set meanwhile
    wins; the request it retires, and its spool copy, are removed)."""
    fallback = {"ok": True, "step": weight, "steps": steps, "fallback": True, "t": time.time(),
                "reason": f"{why}: delta's weight"}
    verdict, retired = store.set_loss_verdict(rid, fallback, lc.VERDICT_TTL_S)
    job_dir = store.meta().get("job_dir")
    if retired and job_dir and is_safe_name(retired):
        confined(lc.spool_dir(job_dir), retired).unlink(missing_ok=True)
    return verdict


def choose(store: JobStore, spec: JobSpec, plan: MergePlan, *, unit: str, model: str, epoch: int,
           result: str, attempt: int | None, weights: Path) -> dict[str, Any] | None:
    """Search ``plan``'s step (set ``plan.step``) before its merge; returns the verdict (None:
    nothing searched: the rule is not ``search``, or the result's base is gone). Raises
    :class:`ResultRejected` when the checker cannot read the result."""
    if not enabled(spec) or plan.base is None or not plan.base_path:
        return None
    # the units issued from the result's base version (none recorded: a unit the generator
    # did not count, such as one regenerated across a crash: taken as a cohort of one),
    # next to the window they were issued into
    cohort = store.issued_from(model, plan.base_version) if plan.base_version is not None else 0
    steps = plan.candidate_steps(cohort or 1)
    weight = min(s for s in steps if s > 0)  # delta's own weight: the fallback
    rid = step_id(unit, attempt, result)
    verdict = store.loss_verdict(rid)
    if verdict is None:
        request = {"unit": unit, "model": model, "epoch": int(epoch), "attempt": attempt, "result": result,
                   "base": plan.base_path, "scale": float(plan.scale), "steps": steps}
        wait = spec.vcasgd.search_wait_s
        queued, per = store.checker_load()
        if per is not None and (queued + 1) * per > wait:
            # The checker would not answer in time: merge now rather than wait in vain
            # (throughput never falls below delta's when the server's forward passes are
            # slow next to the rate results arrive at).
            verdict = _fall_back(store, rid, steps, weight,
                                 f"the checker is behind ({queued} request(s) queued, {per:.3g} s each)")
        else:
            try:
                verdict = lc.ask(store, spec, rid, request, weights, kind="step", what="step search", wait_s=wait)
            except lc.VerdictPending as e:
                verdict = _fall_back(store, rid, steps, weight, f"no step search within {wait:g} s ({e})")
    if verdict.get("ok") is False:
        raise ResultRejected(str(verdict.get("reason") or "the step search could not read the result"),
                             host_fault=True)
    plan.step, plan.step_weight = accepted_step(verdict, weight)
    return verdict
