"""The parameter server: merge a validated result into the server weights in Redis.

VC-ASGD (papers' eq. 1): ``W_s <- a_e*W_s + (1-a_e)*W_c``; MOP replaces the model's
weights (a = 0). The merge is numpy on one flat float32 buffer: no TensorFlow here.
The weights are sharded: the merge applies shard by shard, each shard's update
committed with its "unit applied" mark, and the unit's global mark once every shard
has it (``JobStore.merge``). Each call is idempotent, so BOINC's at-least-once calls
and a late original result of a re-issued unit never merge twice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from boinc_dl.server.common.errors import ResultRejected
from boinc_dl.server.common.spec import JobSpec, spec_from_json
from boinc_dl.server.common.store import JobStore
from boinc_dl.server.validator import norms
from boinc_dl.server.validator.checks import ValidResult, unit_for_workunit, validate_result


@dataclass
class AssimilationOutcome:
    """What happened to one result: merged, duplicate or rejected (with reason)."""

    status: str  # "merged" | "duplicate" | "rejected" | "failed"
    unit: str
    version: int = 0
    reason: str = ""
    retries: int = 0


def merge_into(ws: np.ndarray, wc: np.ndarray, alpha: float) -> np.ndarray:
    """``a*ws + (1-a)*wc`` computed in place in ``ws`` as ``a*(ws - wc) + wc``: three
    passes over float32 and no 20 MB temporary."""
    if alpha == 0.0:
        ws[:] = wc
        return ws
    ws -= wc
    ws *= np.float32(alpha)
    ws += wc
    return ws


def _number(v: Any) -> float | None:
    """A finite float from a host's metrics value, else None."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        f = float(v)
    except OverflowError:  # an int of 400 digits
        return None
    return f if math.isfinite(f) else None


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

    def combine(ws: np.ndarray, sl: slice) -> np.ndarray:
        d = wc[sl] - ws
        sq[sl.start or 0] = float(np.dot(d, d))
        return merge_into(ws, wc[sl], alpha)

    m = res.metrics
    record: dict[str, Any] = {
        "epoch": epoch,
        "shard": info.get("shard"),
        "alpha": alpha,
        "base_version": res.weights.base_version,
        "examples_seen": res.weights.examples_seen,
        # A host's metrics are typed here: what the generator, status and reports read
        # from the merge record is a finite number or None, the host a short string.
        **{k: _number(m.get(k)) for k in ("val_acc", "val_loss", "train_loss", "train_acc", "train_s", "wall_s")},
        "host": str(m["host"])[:64] if isinstance(m.get("host"), str | int) else None,
    }
    if rejected:
        store.record_rejection(unit, str(m.get("result", ""))[:200], rejected[0])
        return AssimilationOutcome("rejected", unit, store.version(model), rejected[0])
    use_strict = spec.vcasgd.merge == "strict" if strict is None else strict
    out = store.merge(model, unit, combine, record, epoch, strict=use_strict)
    if out.given_up:
        reason = "the unit was already given up; a late result is not merged"
        return AssimilationOutcome("duplicate", unit, out.version, reason, out.retries)
    if out.applied and sq:
        norms.record_norm(store, model, math.sqrt(sum(sq.values())))
    if out.applied and spec.mode == "mop" and res.weights.optimizer is not None:
        # MOP hops the optimizer state with the model. Tagged with the weights version it
        # belongs to: a crash before this write only means the next unit starts a fresh
        # optimizer (the generator ignores a blob of another version), never a wrong one.
        store.r.set(store.k("opt", model), res.weights.optimizer.to_bytes(out.version))
    status = "merged" if out.applied else "duplicate"
    return AssimilationOutcome(status, unit, out.version, retries=out.retries)


def assimilate_files(
    store: JobStore,
    paths: Sequence[str | Path],
    spec: JobSpec | None = None,
    result_name: str = "",
    unit: str | None = None,
) -> AssimilationOutcome:
    """Validate then merge a result given by its files (the BOINC entry point's core).

    ``unit`` is the unit the job system issued the result for (never read from the
    file); without it, the unit of the workunit named by ``result_name``
    (``<workunit>_<n>``, BOINC's result names). A rejected result is recorded in Redis
    and reported as ``rejected``; a transient fault (Redis down) propagates as
    :class:`~boinc_dl.server.common.errors.StoreUnavailable`.
    """
    if spec is None:
        spec = spec_from_json(store.spec_json())
    if unit is None:
        wu, sep, seq = result_name.rpartition("_")
        unit = (unit_for_workunit(store, wu) if sep and seq.isdigit() else None) or ""
    try:
        if not unit:
            raise ResultRejected(f"result {result_name[:80]!r} is not a result of a known unit of {store.job!r}")
        res = validate_result(paths, store, spec.units.max_upload_bytes, unit)
    except ResultRejected as e:
        store.record_rejection(unit, result_name, e.reason)
        return AssimilationOutcome("rejected", unit, reason=e.reason)
    if store.is_assimilated(res.unit):
        return AssimilationOutcome("duplicate", res.unit, store.version(res.weights.model))
    return assimilate_valid(store, spec, res)


def assimilate_error(store: JobStore, unit: str, reason: str) -> AssimilationOutcome:
    """A unit that failed for good (BOINC's ``--error`` call): record it, once."""
    info = store.unit_info(unit)
    if info is None:
        return AssimilationOutcome("rejected", unit, reason=f"unknown unit {unit!r}")
    store.mark_failed(unit, reason, int(info.get("epoch", 0)))
    return AssimilationOutcome("failed", unit, reason=reason)
