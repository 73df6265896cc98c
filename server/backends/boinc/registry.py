"""What boinc-dl keeps in Redis about a job's BOINC workunits (the keys and every command on them).

Keys of job J (named through the job store's namespace, so a Redis Cluster keeps them
in the job's slot), plus one project-wide key:

===============================  ======================================================
``bdl:J:boinc:created``          set: workunit names known to exist in BOINC's database
``bdl:J:boinc:issued``           hash unit -> its current workunit ``{"name", "t" (created),
                                 "delay", "attempt"}``
``bdl:J:boinc:live``             hash workunit name -> unit, for workunits BOINC may still
                                 run (forgotten once the assimilator settled them)
``bdl:J:boinc:reissue_now``      set: workunit names to regenerate now (host reclaimed)
``bdl:J:boinc:refused``          hash workunit name -> unit: workunits whose refused result's
                                 unit was to be issued again (each once, kept)
``bdl:J:boinc:refused_pending``  set: those the work generator has not issued again yet
``bdl:J:boinc:refused_count``    hash unit -> how many of its results were refused and
                                 the unit issued again (``validation.reissue_refused``)
``bdl:J:boinc:staged``           set: physical names the job staged into download/ and removes
                                 when it ends (not a created workunit's description: the file deleter's)
``bdl:J:boinc:late_results``     hash result name -> ``{"wu", "reason", "t"}``: results of
                                 superseded or cancelled workunits the validator left
                                 unchecked (not the host's fault, never judged invalid)
``bdl:J:boinc:comparisons``      hash "<result> <result>" -> ``{"unit", "match", "same_host",
                                 "same_user", "t"}``: replicas the compare script judged
``bdl:J:boinc:quorum``           hash of counts over ``comparisons`` (each pair once):
                                 ``comparisons``, ``across_hosts``, ``across_users``,
                                 ``same_host``, ``hosts_unknown``, ``matched``
``bdl:J:boinc:revalidated``      hash workunit name -> when BOINC's validator was asked to judge
                                 its undecided results again (0: it could not be asked)
``bdl:J:boinc:stuck``            hash workunit name -> when the work generator found it stuck
                                 (cancelled, MOP; regenerated, VC-ASGD): each counted once
``bdl:boinc:unresolved_errors``  hash workunit id -> ``{"mask", "t"}``: give-ups whose
                                 workunit name could not be looked up (release 1.2)
===============================  ======================================================
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable

from boinc_dl.server.assimilator.store import PREFIX, JobStore
from boinc_dl.server.common.spec import JobSpec
from boinc_dl.server.common.workunit import parse_unit_name, unit_name

UNRESOLVED_KEY = f"{PREFIX}:boinc:unresolved_errors"

# Record a pair once and count it: HSETNX the entry, then add 1 to each named count.
_RECORD_ONCE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
for i = 3, #ARGV do redis.call('HINCRBY', KEYS[2], ARGV[i], 1) end
return 1
"""

# A live workunit leaves the live records and is counted as cancelled in one step: the work
# generator (after ``bin/cancel_jobs``) and BOINC's ``--error`` call for a cancelled workunit
# both do it, and whichever comes first counts it, once (a generator killed between
# ``cancel_jobs`` and its record leaves the count to the ``--error`` call).
# KEYS: live, the job's counters. ARGV: workunit, counter.
_FORGET_COUNTED = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
return 1
"""

# A refused result's unit is issued again once per workunit, at most ARGV[3] times per unit:
# a re-run of the same call (BOINC re-runs a killed assimilator, also after the work
# generator answered the first) answers the same and counts nothing twice.
# KEYS: refused, refused_pending, refused_count, the job's counters.
_REISSUE_REFUSED = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 1 end
local n = tonumber(redis.call('HGET', KEYS[3], ARGV[2]) or '0')
if n >= tonumber(ARGV[3]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[3], ARGV[2], 1)
redis.call('HINCRBY', KEYS[4], 'reissued_refused', 1)
return 1
"""


class BoincRegistry:
    """The BOINC workunit records of one job (a :class:`~boinc_dl.server.assimilator.framework.Records`)."""

    def __init__(self, store: JobStore):
        self.store = store
        self.created_key = store.k("boinc", "created")
        self.issued_key = store.k("boinc", "issued")
        self.live_key = store.k("boinc", "live")
        self.reissue_key = store.k("boinc", "reissue_now")
        self.staged_key = store.k("boinc", "staged")
        self.refused_key = store.k("boinc", "refused")
        self.refused_pending_key = store.k("boinc", "refused_pending")
        self.refused_count_key = store.k("boinc", "refused_count")
        self.late_key = store.k("boinc", "late_results")
        self.comparisons_key = store.k("boinc", "comparisons")
        self.quorum_key = store.k("boinc", "quorum")
        self.revalidated_key = store.k("boinc", "revalidated")
        self.stuck_key = store.k("boinc", "stuck")

    @property
    def _r(self):  # type: ignore[no-untyped-def]
        return self.store.r

    # ---- creation -------------------------------------------------------------------------
    def mark_created(self, items: Iterable[tuple[str, str, float, int]]) -> None:
        """Workunits ``(name, unit, delay_bound, attempt)`` now exist in BOINC: created,
        live, and their unit's current workunit (one transaction)."""
        items = list(items)
        if not items:
            return
        now = time.time()

        def op() -> None:
            p = self._r.pipeline(transaction=True)
            p.sadd(self.created_key, *[n for n, _, _, _ in items])
            p.hset(self.live_key, mapping={n: u for n, u, _, _ in items})
            p.hset(self.issued_key, mapping={
                u: json.dumps({"name": n, "t": now, "delay": float(d), "attempt": int(a)}) for n, u, d, a in items})
            p.execute()
        self.store.call(op)

    def is_created(self, name: str) -> bool:
        return bool(self.store.call(lambda: self._r.sismember(self.created_key, name)))

    def created(self) -> set[str]:
        return {x.decode() for x in self.store.call(lambda: self._r.smembers(self.created_key))}

    # ---- current workunit of each unit ------------------------------------------------------
    def issued(self, units: list[str]) -> list[dict | None]:
        """Each unit's current-workunit record (None if never created), in order."""
        if not units:
            return []
        raw = self.store.call(lambda: self._r.hmget(self.issued_key, units))
        return [json.loads(v) if v else None for v in raw]

    def issued_all(self) -> dict[str, dict]:
        return {k.decode(): json.loads(v) for k, v in self.store.call(lambda: self._r.hgetall(self.issued_key)).items()}

    def set_issued(self, unit: str, record: dict) -> None:
        self.store.call(lambda: self._r.hset(self.issued_key, unit, json.dumps(record)))

    def current_instance(self, unit: str) -> str | None:
        """The name of the workunit that currently carries ``unit`` (None if never created)."""
        rec = self.issued([unit])[0]
        return str(rec["name"]) if rec else None

    def superseded_by(self, wu: str) -> str | None:
        """The workunit that replaced ``wu``, if boinc-dl regenerated its unit; else None.

        ``wu`` is a BOINC workunit name (from BOINC's arguments or its result file names,
        never from inside a file). A MOP unit re-run under ``<unit>_r<n>`` is a unit of its
        own (its record is its own); a VC-ASGD unit regenerated by re-issue policy
        ``fresh`` keeps its name and runs as ``<unit>_r<n>``.
        """
        parsed = parse_unit_name(wu)
        if not parsed:
            return None
        for unit in (wu, unit_name(parsed["job"], parsed["epoch"], parsed["shard"], parsed["model"])):
            rec = self.issued([unit])[0]
            if rec:
                current = str(rec["name"])
                if current == wu or (unit != wu and self.recorded_behind(rec, wu)):
                    return None
                return current
        return None

    @staticmethod
    def recorded_behind(rec: dict, wu: str) -> bool:
        """Whether ``wu`` is a later attempt of the unit than its recorded current workunit
        ``rec``: BOINC has it (``create_work`` ran) and a daemon killed before recording it
        has not yet been restarted (its recovery records it). Such a workunit is current."""
        parsed = parse_unit_name(wu)
        try:
            return bool(parsed) and int(parsed["attempt"]) > int(rec.get("attempt", 0))
        except (TypeError, ValueError):
            return False

    # ---- workunits BOINC may still run -----------------------------------------------------------
    def live(self) -> dict[str, str]:
        """workunit name -> unit, of the workunits BOINC may still run."""
        return {k.decode(): v.decode() for k, v in self.store.call(lambda: self._r.hgetall(self.live_key)).items()}

    def is_live(self, wu: str) -> bool:
        """Whether BOINC may still run ``wu`` (not settled by the assimilator, not cancelled)."""
        return bool(self.store.call(lambda: self._r.hexists(self.live_key, wu)))

    def forget(self, wu: str) -> None:
        """The assimilator settled ``wu`` (merged, duplicate, superseded, failed): it needs no
        cancelling any more."""
        self.store.call(lambda: self._r.hdel(self.live_key, wu))

    def cancelled(self, wu: str) -> bool:
        """``wu`` was cancelled: ``bin/cancel_jobs`` took it (or BOINC no longer had it), or
        BOINC hands it over with the cancelled bit of its error mask. It leaves the live
        records and counts in ``boinc_cancelled`` in one script, once, whichever of the two
        records it first (True if this call did)."""
        script = self._r.register_script(_FORGET_COUNTED)
        keys = [self.live_key, self.store.k("counters")]
        return bool(self.store.call(lambda: script(keys=keys, args=[wu, "boinc_cancelled"])))

    # ---- stuck workunits -------------------------------------------------------------------
    def mark_stuck(self, wu: str) -> None:
        """The work generator found ``wu`` stuck and ends it (before it cancels the workunit,
        so BOINC's ``--error`` call for it finds the mark); counted once per workunit
        (``boinc_stuck``), whichever pass or restarted daemon marks it again."""
        self._record_once(self.stuck_key, wu, time.time(), ["boinc_stuck"])

    def was_stuck(self, wu: str) -> bool:
        """Whether the work generator ended ``wu`` as stuck."""
        return bool(self.store.call(lambda: self._r.hexists(self.stuck_key, wu)))

    # ---- workunits the validator left undecided -------------------------------------------------
    def revalidated(self, wu: str) -> float | None:
        """When BOINC's validator was asked to judge ``wu`` again (None: never)."""
        raw = self.store.call(lambda: self._r.hget(self.revalidated_key, wu))
        return float(raw) if raw is not None else None

    def mark_revalidated(self, wu: str, asked: bool) -> None:
        """The validator was asked to judge ``wu`` again (``asked``: counted, and recorded with
        the time, which holds the stuck path off for a ``delay_bound``), or it could not be
        (no write access, or decided meanwhile: recorded as time 0, nothing held off);
        either way not again for this workunit."""
        self._record_once(self.revalidated_key, wu, time.time() if asked else 0,
                          ["boinc_revalidated"] if asked else [])

    def _record_once(self, key: str, field: str, value: object, counts: list[str],
                     counts_key: str | None = None) -> bool:
        """HSETNX ``field`` of ``key`` and, if it was new, add 1 to each of ``counts`` in
        ``counts_key`` (the job's counters), in one script: a daemon killed in between
        counts nothing short. True if new."""
        script = self._r.register_script(_RECORD_ONCE)
        keys = [key, counts_key or self.store.k("counters")]
        return bool(self.store.call(lambda: script(keys=keys, args=[field, value, *counts])))

    # ---- early re-issue (reclaimed hosts) ---------------------------------------------------------
    def request_reissue(self, names: Iterable[str]) -> int:
        """Ask the work generator to regenerate these workunits now; returns how many were new."""
        names = list(names)
        if not names:
            return 0
        return int(self.store.call(lambda: self._r.sadd(self.reissue_key, *names)))

    def reissue_requested(self, name: str) -> bool:
        return bool(self.store.call(lambda: self._r.sismember(self.reissue_key, name)))

    def take_reissue_requests(self) -> set[str]:
        """The pending requests; :meth:`done_reissue_requests` drops them once handled."""
        return {x.decode() for x in self.store.call(lambda: self._r.smembers(self.reissue_key))}

    def done_reissue_requests(self, names: set[str]) -> None:
        if names:
            self.store.call(lambda: self._r.srem(self.reissue_key, *names))

    # ---- refused results issued again --------------------------------------------------------
    def reissue_refused(self, wu: str, unit: str, spec: JobSpec) -> bool:
        """The assimilator refused the final result of ``wu`` for what its host computed:
        whether the work generator will issue ``unit`` again (the framework's
        :class:`~boinc_dl.server.assimilator.framework.Records`). Yes for a VC-ASGD job of
        re-issue policy ``fresh``, while ``wu`` is the unit's current workunit, the unit
        has had fewer than ``validation.reissue_refused`` refusals issued again and one
        more workunit stays within ``units.max_total_results``; the request waits in
        ``refused_pending`` for :meth:`refused_pending`."""
        limit = spec.validation.reissue_refused
        parsed = parse_unit_name(wu)
        if spec.mode != "vcasgd" or spec.vcasgd.reissue != "fresh" or limit <= 0 or not parsed:
            return False
        rec = self.issued([unit])[0]
        # (no record yet, or an older one: ``wu`` was created and a killed daemon has not
        # recorded it yet, which only a unit handed to the job system can be; a newer one:
        # ``wu`` is superseded, the newer workunit runs)
        if rec is None and self.store.unit_states_of([unit]) != ["in_progress"]:
            return False
        if rec and rec.get("name") != wu and not self.recorded_behind(rec, wu):
            return False
        if int(parsed["attempt"]) + 1 >= spec.units.max_total_results:
            return False
        script = self._r.register_script(_REISSUE_REFUSED)
        keys = [self.refused_key, self.refused_pending_key, self.refused_count_key, self.store.k("counters")]
        return bool(self.store.call(lambda: script(keys=keys, args=[wu, unit, int(limit)])))

    def refused_pending(self) -> dict[str, str]:
        """Refused workunits whose unit waits to be issued again: workunit name -> unit."""
        names = sorted(x.decode() for x in self.store.call(lambda: self._r.smembers(self.refused_pending_key)))
        if not names:
            return {}
        units = self.store.call(lambda: self._r.hmget(self.refused_key, names))
        return {n: u.decode() for n, u in zip(names, units, strict=True) if u is not None}

    def refused_done(self, names: Iterable[str]) -> None:
        """These refused workunits' units were issued again (or need it no more)."""
        names = list(names)
        if names:
            self.store.call(lambda: self._r.srem(self.refused_pending_key, *names))

    def refused_counts(self) -> dict[str, int]:
        """unit -> how many of its results were refused and the unit issued again."""
        raw = self.store.call(lambda: self._r.hgetall(self.refused_count_key))
        return {k.decode(): int(v) for k, v in raw.items()}

    # ---- late results and replica comparisons (the validator's records) -----------------------
    def record_late_result(self, wu: str, result: str, reason: str) -> bool:
        """A result of a superseded or cancelled workunit reached the validator: it is left
        unchecked (not the host's fault). Recorded once per result; True if new."""
        entry = json.dumps({"wu": wu, "reason": reason, "t": time.time()})
        return bool(self.store.call(lambda: self._r.hsetnx(self.late_key, result, entry)))

    def late_results(self) -> dict[str, dict]:
        return {k.decode(): json.loads(v) for k, v in self.store.call(lambda: self._r.hgetall(self.late_key)).items()}

    def record_comparison(self, unit: str, results: tuple[str, str], match: bool,
                          same_host: bool | None, same_user: bool | None) -> bool:
        """The compare script judged two replicas of ``unit``; ``same_host`` / ``same_user``
        are BOINC's facts about who computed them (None: not known). Each pair counts once
        (BOINC's validator may compare a pair twice, in both orders); True if new."""
        pair = " ".join(sorted(results))
        entry = json.dumps({"unit": unit, "match": bool(match), "same_host": same_host,
                            "same_user": same_user, "t": time.time()})
        fields = ["comparisons"]
        if match:
            fields.append("matched")
        if same_host is None:
            fields.append("hosts_unknown")
        elif same_host:
            fields.append("same_host")
        else:
            fields.append("across_hosts")
        if same_user is False:
            fields.append("across_users")
        return self._record_once(self.comparisons_key, pair, entry, fields, self.quorum_key)

    def quorum_counts(self) -> dict[str, int]:
        """How many replica pairs were compared, and how many across hosts and users."""
        raw = self.store.call(lambda: self._r.hgetall(self.quorum_key))
        return {k.decode(): int(v) for k, v in raw.items()}

    # ---- staged files -----------------------------------------------------------------------------
    def add_staged(self, name: str) -> None:
        self.store.call(lambda: self._r.sadd(self.staged_key, name))

    def release_staged(self, names: Iterable[str]) -> None:
        """These staged files now belong to BOINC's file deleter (a created workunit's own
        description): the job's end leaves them to it."""
        names = list(names)
        if names:
            self.store.call(lambda: self._r.srem(self.staged_key, *names))

    def staged(self) -> list[str]:
        return sorted(x.decode() for x in self.store.call(lambda: self._r.smembers(self.staged_key)))

    def clear_staged(self) -> None:
        self.store.call(lambda: self._r.delete(self.staged_key))


def record_unresolved_error(r: object, wu_id: int, mask: int) -> None:
    """A give-up (``--error``) whose workunit name could not be looked up (release 1.2
    passes only the id and no database access was possible): kept for the admin."""
    r.hset(UNRESOLVED_KEY, str(wu_id), json.dumps({"mask": mask, "t": time.time()}))  # type: ignore[attr-defined]


def unresolved_errors(r: object) -> dict[str, dict]:
    return {k.decode(): json.loads(v) for k, v in r.hgetall(UNRESOLVED_KEY).items()}  # type: ignore[attr-defined]
