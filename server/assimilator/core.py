"""The parameter server: merge a validated result into the server weights in Redis.

How a result is folded in (the merge rule, its staleness and base, the clip radius) is
:mod:`boinc_dl.server.assimilator.policy`'s; the update of a shard is
:mod:`boinc_dl.server.assimilator.rules`' (numpy on float32: no TensorFlow here).
The weights are sharded: the merge applies shard by shard, each shard's update
committed with its "unit applied" mark, and the unit's global mark once every shard
has it (``JobStore.merge``). Each call is idempotent, so BOINC's at-least-once calls
and a late original result of a re-issued unit never merge twice. Results reach this
module only through :mod:`boinc_dl.server.assimilator.framework`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from boinc_dl.server.assimilator import losscheck, policy, rules, stepsearch
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.spec import JobSpec
from boinc_dl.server.validator.checks import ValidResult


@dataclass
class AssimilationOutcome:
    """What happened to one result: merged, duplicate or rejected (with reason)."""

    status: str  # "merged" | "duplicate" | "rejected" | "failed" | "late" | "ignored"
    unit: str
    version: int = 0
    reason: str = ""
    retries: int = 0
    host_fault: bool = False
    """A rejection that judges the host's work (:class:`ResultRejected`'s ``host_fault``):
    the job system may withdraw the host's trust (BOINC: ``backends/boinc/hosttrust.py``)."""
    reissued: bool = False
    """A rejected result's unit is not given up: the job system issues it again (BOINC:
    ``validation.reissue_refused``, :meth:`~boinc_dl.server.backends.boinc.registry.BoincRegistry.reissue_refused`)."""
    judged_stale: bool = False
    """The held-out loss check judged the result against trusted changes from worse
    models (no comparable ones: too little replication); the job system may ask for more
    (BOINC: ``backends/boinc/hosttrust.py``, ``cap_host_trust``)."""


def merge_into(ws: np.ndarray, wc: np.ndarray, alpha: float) -> np.ndarray:
    """The paper's merge ``a*ws + (1-a)*wc``, in place in ``ws`` (the ``paper`` rule)."""
    return rules.MergeRule("paper", alpha).apply(ws, wc, None, 0)


#: The range each host metric may take; a value outside it is recorded as None.
METRIC_RANGES: dict[str, tuple[float, float]] = {
    "val_acc": (0.0, 1.0), "train_acc": (0.0, 1.0),
    "val_loss": (0.0, 1e6), "train_loss": (0.0, 1e6),
    "train_s": (0.0, 30 * 86400.0), "wall_s": (0.0, 30 * 86400.0),
    # The client's own clocks: reading inputs and building the model, the final
    # evaluation, checkpoints, and CPU seconds of the training and of the whole unit.
    "load_s": (0.0, 30 * 86400.0), "eval_s": (0.0, 30 * 86400.0), "checkpoint_s": (0.0, 30 * 86400.0),
    "train_cpu_s": (0.0, 30 * 86400.0), "cpu_s": (0.0, 30 * 86400.0),
    "first_step_cpu_s": (0.0, 30 * 86400.0),  # the unit's first training step (in train_cpu_s)
}


def _number(v: Any, lo: float = -math.inf, hi: float = math.inf) -> float | None:
    """A finite float in [lo, hi] from a host's metrics value, else None."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        f = float(v)
    except OverflowError:  # an int of 400 digits
        return None
    return f if math.isfinite(f) and lo <= f <= hi else None


def assimilate_valid(
    store: JobStore, spec: JobSpec, res: ValidResult, strict: bool | None = None, trusted: bool = False,
    attempt: int | None = None, timing: dict[str, float] | None = None, result: str = "",
    host: str | None = None,
) -> AssimilationOutcome:
    """Merge an already validated result (idempotent; atomic with its mark).

    ``trusted``: the job system vouches for the result (see :mod:`.policy`): its update's
    norm then feeds the clip radius of later epochs. ``attempt``: which issue of the unit
    the result answers (the job system's name for it), hence its base weights.
    ``result``: the job system's name of the result (the held-out loss check's verdict
    is kept under it). ``host``: the job system's id of the host that computed it (the
    loss check's ledger). Raises :class:`ResultRejected` when the loss check refuses the
    result and :class:`~boinc_dl.server.assimilator.losscheck.VerdictPending` (a
    transient fault) when its verdict is not in yet.
    """
    unit = res.unit
    info = store.unit_info(unit) or {}
    epoch = int(info.get("epoch", 0))
    model = str(info.get("model", "0"))
    rejected: list[str] = []
    wc = res.weights.flat
    plan: policy.MergePlan | None = None
    # Checks on the whole model come before any shard is touched: a merge applies shard
    # by shard and cannot take back the shards already applied.
    n = store.layout(model).n
    if n != wc.size:
        rejected.append(f"server weights have {n} values, result {wc.size}")
    else:
        plan = policy.plan_merge(store, spec, info, model, epoch, wc, store.fingerprint(model), attempt)
        cap = spec.validation.max_update_norm
        if cap is not None:
            norm = plan.norm if plan.norm is not None else \
                policy.update_distance(store, info, attempt, model, wc, store.fingerprint(model))
            if not norm <= cap:
                rejected.append(f"update norm {norm:.4g} exceeds max_update_norm {cap:.4g}")

    m = res.metrics
    record: dict[str, Any] = {
        "epoch": epoch,
        "shard": info.get("shard"),
        "base_version_claimed": res.weights.base_version,
        "examples_seen": res.weights.examples_seen,
        # A host's metrics are typed here: what the generator, status and reports read
        # from the merge record is a finite number or None, the host a short string.
        **{k: _number(m.get(k), *METRIC_RANGES[k]) for k in METRIC_RANGES},
        "host": str(m["host"])[:64] if isinstance(m.get("host"), str | int) else None,
        # the job system's id of the host (BOINC's result.hostid: what its ledger and the
        # admin's tables name), never the name the host reported
        "host_id": str(host)[:64] if host else None,
        # the job system's name of the result (BOINC's: its workunit's name and more, so a
        # unit's re-run, <unit>_r1, is told from the original)
        "result": result[:200] or None,
        **{k: _number(v, 0.0, 30 * 86400.0) for k, v in (timing or {}).items()},
    }
    if rejected or plan is None:
        # Under the job system's name for the result, never one the host wrote in its
        # metrics: rejections are recorded once per name, and a host naming all of its
        # refused results alike (or after another's) would hide all but the first.
        store.record_rejection(unit, result, rejected[0], host)
        # Both checks judge the update the host computed: a refusal the host answers for.
        return AssimilationOutcome("rejected", unit, store.version(model), rejected[0], host_fault=True)
    record.update(plan.record(), trusted=trusted)
    # The held-out loss check, last before the merge (it needs the clip scale and the base;
    # an untrusted result waits here for the work generator's verdict, outside any Redis
    # transaction: it adds to this result's time-to-merge, not to other merges).
    t_check = time.perf_counter()
    verdict = losscheck.gate(store, spec, unit=unit, model=model, epoch=epoch, result=result, attempt=attempt,
                             weights=res.files.weights, base_path=plan.base_path if plan.base is not None else None,
                             scale=plan.scale, trusted=trusted, host=host)
    if verdict is not None:
        # the checker's forward passes, and this delivery's whole wait for the verdict
        record.update(loss_increase=verdict.get("loss_increase"), loss_bound=verdict.get("bound"),
                      loss_check_s=verdict.get("check_s"), loss_wait_s=round(time.perf_counter() - t_check, 6),
                      ledger_score=verdict.get("ledger_score"), ledger_balance=verdict.get("ledger_balance"),
                      # whether the bound and the ledger's reference were made of trusted
                      # changes from bases about as good as this one's (rules.BOUND_BASE_RATIO,
                      # rules.BASE_RATIO)
                      bound_comparable=verdict.get("bound_comparable"),
                      ledger_comparable=verdict.get("ledger_comparable"))
        # Other results merged while this one waited: it is merged as stale as it now is
        # (the check judged the update itself, whose clip scale does not change).
        if plan.base_version is not None:
            now = store.version(model)
            if now - plan.base_version > plan.staleness:
                plan.staleness = now - plan.base_version
                record.update(plan.record())
    # merge_rule search: the step the server's forward passes choose for this result at its
    # current weights (after the loss check: a refused result needs none), a verdict like
    # the check's, so every delivery and a re-run after a crash apply the same step.
    t_search = time.perf_counter()
    searched = stepsearch.choose(store, spec, plan, unit=unit, model=model, epoch=epoch, result=result,
                                 attempt=attempt, weights=res.files.weights)
    if searched is not None:
        record.update(plan.record(), step_losses=searched.get("losses"), step_check_s=searched.get("check_s"),
                      step_wait_s=round(time.perf_counter() - t_search, 6),
                      # the server weights' version the search evaluated the steps at
                      step_at_version=searched.get("at_version"),
                      # no search in time: delta's own weight (vcasgd.search_wait_s)
                      step_fallback=bool(searched.get("fallback")))
    use_strict = spec.vcasgd.merge == "strict" if strict is None else strict
    # The rule by name with its parameters (rules.py): a durable merge logs them, and a
    # replay after a Redis crash recomputes the same bytes with the same function.
    record.update(rule=policy.REPLAYABLE, rule_params=plan.params())
    # MOP hops the optimizer state with the model. It is written before the merge, tagged
    # with the version this merge will make: the generator issues the model's next unit as
    # soon as the merge lands and must find the state already there (written after, a busy
    # server let the next unit start a fresh optimizer). One unit per model is in flight, so
    # the next version is this one plus one; a blob of any other version is ignored, so a
    # crash or a duplicate only ever means a fresh optimizer, never a wrong one. A late
    # result of a unit already merged or given up writes nothing (a host could otherwise
    # plant a state for the version the model's next merge makes), and a result without a
    # state clears the stored one: after a merge the state is its result's own, or none.
    carry, predicted = None, 0  # VC-ASGD merges read neither (two round trips saved per merge)
    if spec.mode == "mop" and store.settled_of([unit])[0] == (None, None):
        predicted = store.version(model) + 1
        carry = res.weights.optimizer
        if carry is None:
            store.clear_optimizer_state(model)
        else:
            store.set_optimizer_state(model, carry.to_bytes(predicted))
    out = store.merge(model, unit, plan.combine(wc), record, epoch, strict=use_strict, source=res.files.weights)
    if out.given_up:
        reason = "the unit was already given up; a late result is not merged"
        return AssimilationOutcome("duplicate", unit, out.version, reason, out.retries)
    if out.applied:
        policy.observe(store, model, epoch, plan, trusted)
    if out.applied and carry is not None and out.version != predicted:
        store.set_optimizer_state(model, carry.to_bytes(out.version))
    status = "merged" if out.applied else "duplicate"
    stale = verdict is not None and False in (verdict.get("bound_comparable"), verdict.get("ledger_comparable"))
    return AssimilationOutcome(status, unit, out.version, retries=out.retries, judged_stale=stale)
