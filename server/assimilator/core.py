"""The parameter server: merge a validated result into the server weights in Redis.

VC-ASGD (papers' eq. 1): ``W_s <- a_e*W_s + (1-a_e)*W_c``; MOP replaces the model's
weights (a = 0). The merge is numpy on one flat float32 buffer: no TensorFlow here.
The weights are sharded: the merge applies shard by shard, each shard's update
committed with its "unit applied" mark, and the unit's global mark once every shard
has it (``JobStore.merge``). Each call is idempotent, so BOINC's at-least-once calls
and a late original result of a re-issued unit never merge twice. Results reach this
module only through :mod:`boinc_dl.server.assimilator.framework`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from boinc_dl.server.assimilator import norms, rules
from boinc_dl.server.assimilator.rules import merge_into  # noqa: F401 - part of this module's interface
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


#: The range each host metric may take; a value outside it is recorded as None.
METRIC_RANGES: dict[str, tuple[float, float]] = {
    "val_acc": (0.0, 1.0), "train_acc": (0.0, 1.0),
    "val_loss": (0.0, 1e6), "train_loss": (0.0, 1e6),
    "train_s": (0.0, 30 * 86400.0), "wall_s": (0.0, 30 * 86400.0),
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


def alpha_for(spec: JobSpec, epoch: int) -> float:
    """The merge weight of the server copy for a unit of ``epoch``."""
    return spec.vcasgd.alpha_for(epoch) if spec.mode == "vcasgd" else 0.0


def assimilate_valid(
    store: JobStore, spec: JobSpec, res: ValidResult, strict: bool | None = None
) -> AssimilationOutcome:
    """Merge an already validated result (idempotent; atomic with its mark)."""
    unit = res.unit
    info = store.unit_info(unit) or {}
    epoch = int(info.get("epoch", 0))
    model = str(info.get("model", "0"))
    alpha = alpha_for(spec, epoch)
    bound, source = norms.bound_for(store, spec, model)
    rejected: list[str] = []
    wc = res.weights.flat
    # Checks on the whole model come before any shard is touched: a merge applies shard
    # by shard and cannot take back the shards already applied.
    n = store.layout(model).n
    if n != wc.size:
        rejected.append(f"server weights have {n} values, result {wc.size}")
    elif bound is not None:
        # Against a snapshot (each shard atomic): the bound guards against a wild
        # result, a merge landing in between moves the reference by a step at most.
        reason = norms.check_distance(float(np.linalg.norm(wc - store.snapshot(model).flat)), bound, source)
        if reason:
            rejected.append(reason)
    # The distance for the adaptive bound's statistic, from the shards as merged (no
    # second read of the weights): squared distance per shard, by shard start.
    sq: dict[int, float] = {}
    # The rule by name and parameters (rules.py): a durable merge logs them and a replay
    # after a Redis crash recomputes the same bytes with them.
    rule, rule_params = "alpha", {"alpha": alpha}

    def combine(ws: np.ndarray, sl: slice) -> np.ndarray:
        d = wc[sl] - ws
        sq[sl.start or 0] = float(np.dot(d, d))
        return rules.apply(rule, ws, wc[sl], rule_params)

    m = res.metrics
    record: dict[str, Any] = {
        "epoch": epoch,
        "shard": info.get("shard"),
        "alpha": alpha,
        "rule": rule,
        "rule_params": rule_params,
        "base_version": res.weights.base_version,
        "examples_seen": res.weights.examples_seen,
        # A host's metrics are typed here: what the generator, status and reports read
        # from the merge record is a finite number or None, the host a short string.
        **{k: _number(m.get(k), *METRIC_RANGES[k]) for k in METRIC_RANGES},
        "host": str(m["host"])[:64] if isinstance(m.get("host"), str | int) else None,
    }
    if rejected:
        store.record_rejection(unit, str(m.get("result", ""))[:200], rejected[0])
        return AssimilationOutcome("rejected", unit, store.version(model), rejected[0])
    use_strict = spec.vcasgd.merge == "strict" if strict is None else strict
    out = store.merge(model, unit, combine, record, epoch, strict=use_strict, source=res.files.weights)
    if out.given_up:
        reason = "the unit was already given up; a late result is not merged"
        return AssimilationOutcome("duplicate", unit, out.version, reason, out.retries)
    if out.applied and sq:
        norms.record_norm(store, model, math.sqrt(sum(sq.values())))
    if out.applied and spec.mode == "mop" and res.weights.optimizer is not None:
        # MOP hops the optimizer state with the model. Tagged with the weights version it
        # belongs to: a crash before this write only means the next unit starts a fresh
        # optimizer (the generator ignores a blob of another version), never a wrong one.
        store.set_optimizer_state(model, res.weights.optimizer.to_bytes(out.version))
    status = "merged" if out.applied else "duplicate"
    return AssimilationOutcome(status, unit, out.version, retries=out.retries)
