"""Spot checks the held-out loss check needs: units the work generator replicates itself.

The loss check and the hosts' ledgers (docs/merge-rules.md) judge an untrusted result
against *trusted* loss changes: those of results BOINC replicated and whose replicas,
from different hosts, agreed. A project of ``min_quorum`` 1 gets replicas only from
BOINC's adaptive replication, which an admin must turn on (the app's
``target_nresults``), and which replicates a trusted host rarely. So a job could start
with nothing trusted (the check passes everything until ``loss_check_min_trusted``
trusted results exist), and a job whose model has improved since its last replica
judges results against changes from worse models (counted per model in
``bdl:J:losscheck:stale``; docs/merge-rules.md, "Trusted changes from worse models").

Here the work generator asks for the replicas itself: it gives a unit ``min_quorum``
and ``target_nresults`` 2 (a *spot check*)

* while the job has fewer trusted loss changes measured than ``loss_check_min_trusted``,
  counting spot checks still open (``bootstrap``): that many units are replicated at the
  start, and more only if some end without a trusted measurement (or merge a moment
  before the checker measures them);
* once ``validation.loss_check_spot_every`` more results have been judged against
  changes from worse models since the last such spot check (``stale``): about one
  unit in that many while the reference is stale, none once it is not.

Only a unit's first workunit is a spot check (a regenerated one keeps the project's
quorum, so a replica no host takes never holds a unit past its deadline twice), only
with two or more hosts active (a lone host could not take the replica), and only where
the unit may run two results (``units.max_total_results``). ``boinc install`` sets
config.xml's ``<one_result_per_host_per_wu>`` so that the replica goes to another host
(:mod:`.quorum`).

Every decision is recorded per unit in Redis before the workunit is created (a spot
check in one script with the stale count it used; a unit that is not one in a set): a
work generator killed in between, even after ``create_work`` and before it marked the
unit created, makes the same decision for that unit after its restart, and never counts
one stale stretch twice.

Keys of job J (the job store's namespace):

==================================  ==================================================
``bdl:J:boinc:spot_checks``         hash unit -> ``{"why", "stale", "t"}``: units given
                                    a quorum of 2 for the loss check
``bdl:J:boinc:spot_checks_stale``   the stale count the last ``stale`` spot check used
``bdl:J:boinc:spot_declined``       set: units decided to keep the project's quorum
==================================  ==================================================
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from boinc_dl.server.assimilator import losscheck as lc
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.spec import JobSpec
from boinc_dl.server.common.states import SETTLED

log = logging.getLogger(__name__)

#: The quorum of a spot check: one replica from another host.
SPOT_QUORUM = 2

# Record a unit's spot check once, with the stale count it used (when it used one).
_RECORD = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
if ARGV[3] ~= '' then redis.call('SET', KEYS[2], ARGV[3]) end
return 1
"""


def wanted(trusted: int, open_checks: int, stale: int, stale_seen: int, min_trusted: int,
           every: int) -> str | None:
    """Why the next unit should be a spot check (``"bootstrap"``, ``"stale"``), or None.

    ``trusted``: trusted loss changes the job has; ``open_checks``: spot checks not yet
    ended; ``stale``: results judged against changes from worse models so far, and
    ``stale_seen`` the count at the last ``stale`` spot check; ``every`` 0 turns both off."""
    if every <= 0:
        return None
    if trusted + open_checks < min_trusted:
        return "bootstrap"
    if stale - stale_seen >= every:
        return "stale"
    return None


class SpotChecks:
    """The spot-check decisions of the jobs one work generator creates units for."""

    def __init__(self, store_of: Callable[[str], JobStore], active_hosts: Callable[[], int | None]):
        """``store_of``: the job store of a job; ``active_hosts``: hosts that contacted
        the project recently (None: BOINC's host table is unreadable)."""
        self.store_of = store_of
        self.active_hosts = active_hosts

    @staticmethod
    def applies(spec: JobSpec, project_quorum: int, max_total_results: int) -> bool:
        """Whether units of ``spec``'s job may be spot checks at all."""
        return (lc.enabled(spec) and spec.validation.loss_check_spot_every > 0 and project_quorum < SPOT_QUORUM
                and max_total_results >= SPOT_QUORUM)

    def quorum(self, spec: JobSpec, unit: str, attempt: int, project_quorum: int, max_total_results: int) -> int:
        """The quorum of ``unit``'s workunit: :data:`SPOT_QUORUM` for a spot check (decided
        now, or earlier for this unit), else ``project_quorum``."""
        if not self.applies(spec, project_quorum, max_total_results):
            return project_quorum
        if attempt > 0:
            return project_quorum
        store = self.store_of(spec.name)
        keys = _keys(store)
        # decided before a restart (perhaps created, never marked so): the same decision
        if store.call(lambda: store.r.hexists(keys[0], unit)):
            return SPOT_QUORUM
        if store.call(lambda: store.r.sismember(keys[2], unit)):
            return project_quorum
        why, stale = self._why(store, spec)
        hosts = self.active_hosts() if why is not None else None
        if why is None or hosts is None or hosts < SPOT_QUORUM:
            if why is not None:
                log.debug("job %s: no spot check for %s (%s active host(s))", spec.name, unit, hosts)
            store.call(lambda: store.r.sadd(keys[2], unit))
            return project_quorum
        record = json.dumps({"why": why, "stale": stale, "t": round(time.time(), 3)})
        script = store.r.register_script(_RECORD)
        store.call(lambda: script(keys=list(keys[:2]), args=[unit, record, str(stale) if why == "stale" else ""]))
        log.info("job %s: unit %s is a spot check (quorum %d: %s)", spec.name, unit, SPOT_QUORUM,
                 "too few trusted results for the loss check" if why == "bootstrap"
                 else f"{stale} results judged against trusted results from worse models")
        return SPOT_QUORUM

    def _why(self, store: JobStore, spec: JobSpec) -> tuple[str | None, int]:
        v = spec.validation
        model = "0"  # VC-ASGD's one model
        # Trusted results the loss check has measured: what it needs. One merged but not yet
        # measured (the checker is a moment behind) counts as neither open nor trusted and
        # may bring one spot check more; one whose measurement was lost (the daemon killed
        # mid-measurement) is made up for, where counting merges would leave the check off.
        trusted = store.trusted_count(model, lc.STAT)
        need = lc.trusted_needed(spec)
        stale = store.loss_checks_stale().get(model, 0)
        keys = _keys(store)
        seen = int(store.call(lambda: store.r.get(keys[1])) or 0)
        open_checks = 0
        if trusted < need:  # only then (the trusted lists never shrink)
            units = [k.decode() for k in store.call(lambda: store.r.hkeys(keys[0]))]
            open_checks = sum(1 for s in store.unit_states_of(units) if s not in SETTLED)
        return wanted(trusted, open_checks, stale, seen, need, v.loss_check_spot_every), stale


def spot_checks(store: JobStore) -> dict[str, dict]:
    """The job's spot checks: unit -> ``{"why", "stale", "t"}``."""
    key = _keys(store)[0]
    return {k.decode(): json.loads(v) for k, v in store.call(lambda: store.r.hgetall(key)).items()}


def _keys(store: JobStore) -> tuple[str, str, str]:
    return store.k("boinc", "spot_checks"), store.k("boinc", "spot_checks_stale"), store.k("boinc", "spot_declined")
