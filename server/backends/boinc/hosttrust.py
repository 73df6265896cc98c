"""A refused result costs its host BOINC's trust, as an invalid one does.

BOINC's validator has already called a result valid when boinc-dl's assimilator refuses
it (the held-out loss check, the hard update cap, a file whose content does not match its
unit). BOINC's adaptive replication would never learn of the refusal: the host would keep
its run of ``host_app_version.consecutive_valid`` and keep receiving unreplicated work.
So the BOINC intake does here what BOINC's validator does for an invalid result
(``is_invalid``, ``sched/validator.cpp``): it sets that host app version's
``consecutive_valid`` to 0, and BOINC's scheduler replicates the host's next jobs
(``set_trust``, ``sched/sched_send.cpp``: below 10 consecutive valid results, never a
single replica).

* *Which refusals.* Only those that judge what the host computed
  (:class:`~boinc_dl.server.common.errors.ResultRejected`'s ``host_fault``): the loss
  check, ``max_update_norm``, the result's content (format, fingerprint, names it embeds,
  NaN). A unit already settled, files the file deleter removed, a unit the job does not
  know, an upload the server cannot read, an error of the assimilator: none of them says
  anything about the host, and none costs it anything.
* *Which host.* BOINC's ``result`` row named by BOINC (the result name the intake got
  from BOINC's file names), its ``hostid`` and ``app_version_id``: never the result file.
* *Idempotent.* Setting 0 again is harmless; the job's record (``host_demotions`` of
  :class:`~boinc_dl.server.assimilator.store.JobStore`) counts a result once.
* *Failure-tolerant.* The refusal stands whatever happens here. With BOINC's database
  unreachable the demotion is logged, counted (``host_demotions_failed``) and kept as
  pending; the next refusal of the job retries the pending ones (a few per call).

A merged result that the held-out loss check could only judge against trusted changes
from worse models (too little replication since the model improved; see
docs/merge-rules.md, "Trusted changes from worse models") lowers its host's
``consecutive_valid`` to at most :data:`STALE_TRUST_CAP` (:func:`cap_host_trust`): BOINC
then spot-checks that host's jobs at least once in that many, and the replicas are the
trusted results the check needs. Hosts below the cap are untouched; nothing is recorded
beyond the log (the count of such verdicts is the job's ``loss_checks_stale``).
"""

from __future__ import annotations

import logging

from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.boinc.boincdb import BoincDB, BoincDBError, TrustReset
from boinc_dl.server.backends.boinc.project import BoincProject
from boinc_dl.server.common.errors import StoreUnavailable

log = logging.getLogger("boinc-dl.hosttrust")

#: Pending demotions retried per refusal: a bounded amount of work per assimilator call.
RETRY_PER_CALL = 8
#: The most ``consecutive_valid`` a host keeps while the loss check lacks comparable
#: trusted results: BOINC replicates its jobs with probability at least 1/20 (the 5%
#: spot checks under which the check and the ledgers were measured).
STALE_TRUST_CAP = 20


def cap_host_trust(project: BoincProject, result: str, cap: int = STALE_TRUST_CAP) -> TrustReset | None:
    """Lower the ``consecutive_valid`` of merged result ``result``'s host app version to
    at most ``cap`` (see the module doc); what it was (None: nothing, or BOINC's database
    could not be reached). Never raises: the merge stands either way."""
    try:
        with BoincDB.connect(project, writable=True) as db:
            got = db.cap_consecutive_valid(result, cap)
    except BoincDBError as e:
        log.warning("host of %s not asked for more spot checks (BOINC's database: %s)", result, e)
        return None
    if got is not None and got.before is not None and got.before > cap:
        log.info("result %s was judged against trusted results from worse models: host %d (app version %d) "
                 "consecutive_valid %d -> %d, so BOINC spot-checks its jobs more often",
                 result, got.hostid, got.app_version_id, got.before, cap)
    return got


def demote_host(project: BoincProject, store: JobStore, result: str, reason: str) -> TrustReset | None:
    """Withdraw BOINC's trust in the host of refused result ``result`` (see the module
    doc), then retry the job's pending demotions; what was reset for ``result`` (None:
    nothing, or BOINC's database could not be reached). Never raises: the refusal is
    recorded already and stands either way."""
    try:
        if (store.host_demotion(result) or {}).get("done"):
            return None  # a re-delivered result: its host was handled already
        todo = [result] + [r for r in store.pending_host_demotions(RETRY_PER_CALL) if r != result]
    except StoreUnavailable as e:
        # BOINC's database is what the scheduler reads: demote the host all the same.
        log.warning("Redis unavailable (%s): the demotion of the host of %s goes unrecorded", e, result)
        todo = [result]
    done: TrustReset | None = None
    handled = False  # whether ``result`` itself went through
    try:
        with BoincDB.connect(project, writable=True) as db:
            for name in todo:
                why = reason if name == result else _reason_of(store, name)
                reset = db.reset_consecutive_valid(name)
                _record(store, name, why, reset, error=None)
                if name == result:
                    done, handled = reset, True
    except BoincDBError as e:
        if not handled:
            log.warning("host of refused result %s not demoted (BOINC's database: %s); "
                        "retried with the job's next refused result", result, e)
            _record(store, result, reason, None, error=str(e))
        else:  # the others stay pending for the next call
            log.warning("pending host demotions not retried (BOINC's database: %s)", e)
    return done


def _reason_of(store: JobStore, result: str) -> str | None:
    """The refusal reason kept with a pending demotion (None if Redis cannot say)."""
    try:
        return (store.host_demotion(result) or {}).get("reason")
    except StoreUnavailable:
        return None


def _record(store: JobStore, result: str, reason: str | None, reset: TrustReset | None, error: str | None) -> None:
    """Log and keep one demotion's outcome in the job's store (a Redis outage loses only
    the record: BOINC's database is what the scheduler reads)."""
    entry: dict[str, object] = {}
    if reason is not None:
        entry["reason"] = reason[:300]
    if error is not None:
        entry["error"] = error[:300]
    elif reset is None:
        entry["note"] = "BOINC has no result of that name sent to a host"
    else:
        entry.update(host=reset.hostid, app_version=reset.app_version_id, consecutive_valid_before=reset.before)
        if reset.before is None:
            log.info("refused result %s: host %d has no host_app_version row for app version %d; nothing to reset",
                     result, reset.hostid, reset.app_version_id)
        else:
            log.warning("refused result %s: host %d (app version %d) demoted, consecutive_valid %d -> 0: "
                        "BOINC replicates its next jobs", result, reset.hostid, reset.app_version_id, reset.before)
    try:
        store.record_host_demotion(result, entry, done=error is None,
                                   demoted=reset is not None and reset.before is not None)
    except StoreUnavailable as e:
        log.warning("demotion of the host of %s not recorded: Redis unavailable (%s)", result, e)
