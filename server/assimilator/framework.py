"""The one assimilation path: every transport hands a result, or a give-up, to :func:`assimilate`.

Results reach the parameter server three ways: the local backend's assimilator
processes, the script BOINC's ``script_assimilator`` runs, and the docker stack's spool
consumer. They differ only in how a result travels; what happens to it is decided
here, once, in this order:

1. **identify** the unit from the job system's names (the workunit a result was
   uploaded for), never from inside the files;
2. **late calls**: a call about a workunit the job system has superseded (BOINC: a
   regenerated unit's cancelled original), or a result of a cancelled unit, is
   counted and otherwise ignored: it may not touch the unit;
3. **give-ups**: the job system failed the workunit for good, or its files are gone:
   the unit is marked failed once (nothing if it is already settled);
4. **validate** the files against what the unit expects (job, unit, model, fingerprint);
5. **merge** into the server weights (idempotent: a re-run is a duplicate);
6. **reject**: a result that fails a check is recorded with its reason; when no other
   result of the workunit will come (BOINC's assimilator is the last step), the unit
   is given up so that its epoch can close, unless the refusal judged the host's work
   and the job system issues the unit again (:meth:`Records.reissue_refused`);
7. **settle**: the job system's own records of the workunit are told it is done.

Anything a result provokes that no check foresaw becomes a rejection with its reason,
never a dead daemon. Only a transient fault (Redis unreachable:
:class:`~boinc_dl.server.common.errors.StoreUnavailable`; or the held-out loss check's
verdict on an untrusted result not in yet, its subclass
:class:`~boinc_dl.server.assimilator.losscheck.VerdictPending`) propagates: the transport
keeps the result and retries, as BOINC re-runs an assimilator that exits non-zero.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from boinc_dl.server.assimilator import persistence
from boinc_dl.server.assimilator.core import AssimilationOutcome, assimilate_valid
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common import diskfaults
from boinc_dl.server.common.errors import ResultRejected, StoreUnavailable, UnknownJob
from boinc_dl.server.common.paths import check_name, is_safe_name
from boinc_dl.server.common.spec import JobSpec, spec_from_json
from boinc_dl.server.common.states import SETTLED
from boinc_dl.server.common.workunit import parse_unit_name, unit_name
from boinc_dl.server.validator.checks import Expected, identify_files, validate_result

log = logging.getLogger(__name__)

class Records(Protocol):
    """What a job system keeps about its workunits, as the framework needs it."""

    def superseded_by(self, workunit: str) -> str | None:
        """The workunit that replaced ``workunit``, or None when it is current."""

    def forget(self, workunit: str) -> None:
        """``workunit`` is settled: drop it from the job system's live records."""

    def reissue_refused(self, workunit: str, unit: str, spec: JobSpec) -> bool:
        """The final result of ``workunit`` (carrying ``unit``) was refused for what its host
        computed: whether the job system will issue the unit again (then it is not given
        up). Idempotent per workunit: a re-run of the same call answers the same."""


class NoRecords:
    """A job system that supersedes nothing and keeps no live records (the local backend)."""

    def superseded_by(self, workunit: str) -> str | None:
        return None

    def forget(self, workunit: str) -> None:
        return None

    def reissue_refused(self, workunit: str, unit: str, spec: JobSpec) -> bool:
        return False


@dataclass
class Delivery:
    """One call from a job system: a result of a workunit, or its give-up.

    Everything here comes from the job system (its names, its verdicts), never from
    the files a host wrote.
    """

    workunit: str
    """The job system's workunit name (BOINC's; the local backend's unit)."""
    result: str = ""
    """The job system's result name, for the records."""
    unit: str | None = None
    """The unit, when the job system knows it exactly (the local backend's record of
    what a slot ran); else it is derived from ``workunit``."""
    files: Callable[[], Sequence[Path]] | Sequence[Path] = ()
    """The result's files, or a function that prepares them (copies, unpacks) and is
    called only once the result is known to matter; it may raise ResultRejected."""
    missing: Sequence[str] = ()
    """Files the job system named for the result that are gone (BOINC's file deleter)."""
    error: str | None = None
    """The job system gave up on the workunit for good: why."""
    final: bool = True
    """No other result of this workunit will come (BOINC's assimilator): a rejected
    result gives the unit up. False where the job system re-issues an invalid result's
    unit itself (the local backend)."""
    trusted: bool = False
    """The job system vouches for the result (the local backend's own hosts; on BOINC, a
    result that agreed with a replica from another host): its update may feed the clip
    radius (:mod:`boinc_dl.server.assimilator.policy`)."""
    host: str | None = None
    """The job system's id of the host that computed the result (BOINC's
    ``result.hostid``): its loss ledger (:func:`~boinc_dl.server.assimilator.losscheck.settle`).
    None where the job system names none (the local backend's own hosts)."""
    notes: dict[str, str] = field(default_factory=dict)


def unit_for_workunit(store: JobStore, wu_name: str) -> str | None:
    """The unit a workunit name stands for: itself when registered (MOP's attempts are
    units of their own), else the unit it regenerates (``<unit>_r<n>``); None if neither."""
    if not is_safe_name(wu_name):
        return None
    if store.unit_info(wu_name) is not None:
        return wu_name
    p = parse_unit_name(wu_name)
    if p and p["attempt"] and p["job"] == store.job:
        base = unit_name(p["job"], p["epoch"], p["shard"], p["model"])
        if store.unit_info(base) is not None:
            return base
    return None


def attempt_of(delivery: Delivery) -> int | None:
    """Which issue of its unit a result answers, from the job system's names: its result
    name ``<workunit>_<n>`` (BOINC's, and the local backend's instances), else the
    workunit's (``<unit>_r<attempt>``)."""
    wu, sep, seq = delivery.result.rpartition("_")
    for name in ((wu,) if sep and seq.isdigit() else ()) + (delivery.workunit,):
        parsed = parse_unit_name(name) if is_safe_name(name) else None
        if parsed:
            return int(parsed["attempt"])
    return None


def expected_of(store: JobStore, unit: str) -> Expected:
    """What a result of ``unit`` must be, from the job's records (ResultRejected if unknown)."""
    check_name(unit, "unit")
    info = store.unit_info(unit)
    if info is None:
        raise ResultRejected(f"unknown unit {unit!r} for job {store.job!r}")
    model = str(info.get("model", "0"))
    try:
        return Expected(store.job, unit, model, store.fingerprint(model))
    except UnknownJob as e:
        raise ResultRejected(str(e)) from None


def assimilate(store: JobStore, delivery: Delivery, records: Records | None = None,
               spec: JobSpec | None = None) -> AssimilationOutcome:
    """Handle one job-system call about a workunit of ``store``'s job (see the module doc).

    Returns the outcome; raises only :class:`StoreUnavailable` and, for a server-side
    I/O fault (a full disk), :class:`~boinc_dl.server.common.diskfaults.ServerResourceError`.
    """
    records = records or NoRecords()
    wu = delivery.workunit
    try:
        if not store.exists():
            return AssimilationOutcome("ignored", wu, reason=f"job {store.job!r} is not in Redis")
        unit = delivery.unit or unit_for_workunit(store, wu) or ""
        current = records.superseded_by(wu)
        if current is not None:
            log.info("%s: a late call about a superseded workunit (the unit now runs as %s); "
                     "nothing recorded", wu, current)
            store.incr_counter("superseded_calls")
            records.forget(wu)
            return AssimilationOutcome("late", unit or wu, reason=f"workunit superseded by {current}")
        state = store.unit_states_of([unit])[0] if unit else None
        if state == "cancelled":
            records.forget(wu)
            return AssimilationOutcome("late", unit, reason="the unit was cancelled")
        if delivery.error is not None or delivery.missing:
            out = _give_up(store, unit or wu, state, delivery)
        else:
            out = _merge(store, unit, delivery, spec, records)
        records.forget(wu)
        return out
    except StoreUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - no input may kill the parameter server
        # A fault that names no file is Redis refusing to write its AOF: its own directory
        # is where the space is missing, not this process's working directory.
        fault = diskfaults.as_server_error(e, lambda: persistence.data_dir(store.r) or os.getcwd())
        if fault is not None:  # the server's disk: its fault, never the result's (nothing recorded)
            raise fault from None
        log.exception("assimilation of %s (%s): unexpected error", wu, delivery.result)
        return reject(store, delivery, delivery.unit or wu, f"assimilator error: {type(e).__name__}: {e}")


def _give_up(store: JobStore, unit: str, state: str | None, delivery: Delivery) -> AssimilationOutcome:
    """The workunit failed for good, or its result's files are gone."""
    if state in SETTLED:
        # e.g. the file deleter removed the files of a unit already merged or given up
        return AssimilationOutcome("late", unit, reason=f"the unit is already {state}")
    if delivery.error is not None:
        reason = delivery.error
    else:
        reason = f"result files missing on the server: {', '.join(Path(m).name for m in delivery.missing)}"
        store.record_rejection(unit, delivery.result, reason)
    return give_up(store, unit, reason)


def give_up(store: JobStore, unit: str, reason: str) -> AssimilationOutcome:
    """Mark ``unit`` failed for good, once (an unknown unit is reported, not recorded)."""
    info = store.unit_info(unit)
    if info is None:
        return AssimilationOutcome("rejected", unit, reason=f"unknown unit {unit!r}")
    store.mark_failed(unit, reason, int(info.get("epoch", 0)))
    return AssimilationOutcome("failed", unit, reason=reason)


def _merge(store: JobStore, unit: str, delivery: Delivery, spec: JobSpec | None,
           records: Records) -> AssimilationOutcome:
    if not unit:
        return reject(store, delivery, delivery.workunit,
                      f"result {delivery.result[:80]!r} is not a result of a known unit of {store.job!r}")
    if store.is_assimilated(unit):
        # A re-sent or late result of a merged unit: a duplicate, without reading it.
        return AssimilationOutcome("duplicate", unit, reason="the unit is already merged")
    spec = spec or spec_from_json(store.spec_json())
    try:
        paths = delivery.files() if callable(delivery.files) else delivery.files
        expected = expected_of(store, unit)
        _prefetch(store, unit, expected.model, paths, spec.units.max_upload_bytes)
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            res = validate_result(paths, expected, spec.units.max_upload_bytes)
        except ResultRejected as e:
            # The checks of the file's content against what the unit issued (format,
            # fingerprint, embedded names, NaN): what the host computed is wrong.
            raise ResultRejected(e.reason, host_fault=True) from None
        # The validation's own duration, on this assimilator's clock, for the merge record.
        timing = {"validate_s": round(time.perf_counter() - t0, 6),
                  "validate_cpu_s": round(time.thread_time() - cpu0, 6)}
        out = assimilate_valid(store, spec, res, trusted=delivery.trusted, attempt=attempt_of(delivery),
                               timing=timing, result=delivery.result, host=delivery.host)
    except ResultRejected as e:
        return reject(store, delivery, unit, e.reason, host_fault=e.host_fault, records=records, spec=spec)
    finally:
        store.release_inputs()  # a retained copy no merge logged (rejected, duplicate)
    if out.status == "rejected":
        return _settle_rejection(store, delivery, unit, out, records, spec)
    return out


def _prefetch(store: JobStore, unit: str, model: str, paths: Sequence[Path], max_bytes: int) -> None:
    """Retain the result's weights file before it is validated: a durable merge logs it by
    name, and its hashing and syncing then overlap the validation (mergelog.py)."""
    try:
        weights = identify_files(paths).weights
    except ResultRejected:
        return  # validation says why
    store.prefetch_input(unit, model, weights, max_bytes)


def reject(store: JobStore, delivery: Delivery, unit: str, reason: str, host_fault: bool = False,
           records: Records | None = None, spec: JobSpec | None = None) -> AssimilationOutcome:
    """Record a rejected result of ``unit`` (and give the unit up when the result was final,
    unless ``records`` issue it again); ``host_fault``: the refusal judges the host's work
    (:class:`ResultRejected`)."""
    store.record_rejection(unit, delivery.result, reason, delivery.host)
    return _settle_rejection(store, delivery, unit,
                             AssimilationOutcome("rejected", unit, reason=reason, host_fault=host_fault),
                             records, spec)


def _settle_rejection(store: JobStore, delivery: Delivery, unit: str, out: AssimilationOutcome,
                      records: Records | None = None, spec: JobSpec | None = None) -> AssimilationOutcome:
    info = store.unit_info(unit) if delivery.final and unit else None
    if info is not None and not store.is_assimilated(unit):
        if out.host_fault and records is not None and spec is not None \
                and records.reissue_refused(delivery.workunit, unit, spec):
            # Another host computes the unit again, from the freshest weights: refusing a
            # host's result does not cost the epoch the unit's subset (measured: a refused
            # unit given up costs about as much accuracy as a merged attack).
            out.reissued = True
            return out
        # BOINC considers the workunit done: give it up so the epoch can close.
        store.mark_failed(unit, f"rejected at assimilation: {out.reason}", int(info.get("epoch", 0)))
    return out

