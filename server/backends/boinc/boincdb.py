"""Access to a BOINC project's database (MariaDB/MySQL), bounded and parametrized.

BOINC alone knows when a result was *sent* (``result.sent_time``), when it is due
(``result.report_deadline = sent_time + workunit.delay_bound``, ``sched/sched_send.cpp``)
and whether it came back (``server_state``/``outcome``/``validate_state``). boinc-dl
reads those facts here instead of guessing them from workunit creation times.

* Credentials come from the project's ``config.xml`` (``db_name``, ``db_host``,
  ``db_user``, ``db_passwd``, optional ``db_port`` and ``db_socket``), as BOINC's own
  tools read them (``sched/sched_config.cpp``). ``db_host`` may be ``host:port``.
* Every session is read-only (``SET SESSION TRANSACTION READ ONLY``) except one opened
  with ``writable=True`` for the two writes boinc-dl makes: what BOINC's validator does
  to the host of an invalid result (:meth:`BoincDB.reset_consecutive_valid`), and what
  BOINC's own ops page ``revalidate.php`` does to a workunit whose results the validator
  could not judge (:meth:`BoincDB.ask_revalidation`); every query is
  parametrized, has a row limit and runs under connect/read timeouts, so a slow or
  unreachable database degrades boinc-dl (logged, retried next pass) instead of
  hanging a daemon.

The constants are BOINC's (``db/boinc_db_types.h``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from boinc_dl.server.backends.boinc.project import BoincProject
from boinc_dl.server.common.errors import BoincDLError

log = logging.getLogger(__name__)

# result.server_state
RESULT_SERVER_STATE_INACTIVE = 1
RESULT_SERVER_STATE_UNSENT = 2
RESULT_SERVER_STATE_IN_PROGRESS = 4
RESULT_SERVER_STATE_OVER = 5
# result.outcome
RESULT_OUTCOME_INIT = 0
RESULT_OUTCOME_SUCCESS = 1
RESULT_OUTCOME_COULDNT_SEND = 2
RESULT_OUTCOME_CLIENT_ERROR = 3
RESULT_OUTCOME_NO_REPLY = 4
RESULT_OUTCOME_DIDNT_NEED = 5
RESULT_OUTCOME_VALIDATE_ERROR = 6
RESULT_OUTCOME_CLIENT_DETACHED = 7
# result.validate_state
VALIDATE_STATE_INIT = 0
VALIDATE_STATE_VALID = 1
VALIDATE_STATE_INVALID = 2
VALIDATE_STATE_INCONCLUSIVE = 4
# workunit.assimilate_state
# workunit.error_mask bits, WU_ERROR_* (db/boinc_db_types.h)
WU_ERRORS = {
    1: "couldn't send a result",
    2: "too many error results",
    4: "too many success results without consensus",
    8: "too many total results",
    16: "cancelled",
    32: "no canonical result",
}
WU_ERROR_CANCELLED = 16

ASSIMILATE_INIT = 0
ASSIMILATE_READY = 1
ASSIMILATE_DONE = 2

#: Outcomes after which BOINC needs (or re-creates) another instance of the workunit.
LOST_OUTCOMES = (RESULT_OUTCOME_CLIENT_ERROR, RESULT_OUTCOME_NO_REPLY, RESULT_OUTCOME_VALIDATE_ERROR,
                 RESULT_OUTCOME_CLIENT_DETACHED)

#: Names per ``IN (...)`` query and rows per query: bounded work per call.
CHUNK = 500
MAX_ROWS = 100_000


class BoincDBError(BoincDLError):
    """BOINC's database is not configured, unreachable, or a query failed."""


@dataclass(frozen=True)
class ResultRow:
    """The columns of one ``result`` row boinc-dl uses."""

    id: int
    name: str
    server_state: int
    outcome: int
    validate_state: int
    sent_time: int
    report_deadline: int
    received_time: int
    hostid: int
    create_time: int = 0
    userid: int = 0


@dataclass(frozen=True)
class Takers:
    """Who could take a workunit's unsent replica: the hosts that contacted the scheduler
    lately, ``(hostid, userid, rpc_time)``, and config.xml's rule for replicas
    (:func:`~boinc_dl.server.backends.boinc.quorum.replica_rule`: ``"users"``, no two
    results of a workunit to one account; ``"hosts"``, none to one host; None, any)."""

    hosts: tuple[tuple[int, int, int], ...]
    rule: str | None

    def may_take(self, wu: WorkunitState, now: float) -> bool:
        """Some host seen within the workunit's ``delay_bound`` may be sent its replica
        (``slow_check``, ``sched/sched_check.cpp``: the user rule first, then the host
        rule, over the results already sent)."""
        sent = [r for r in wu.results if r.server_state >= RESULT_SERVER_STATE_IN_PROGRESS]
        users = {r.userid for r in sent}
        hosts = {r.hostid for r in sent}
        for hostid, userid, rpc_time in self.hosts:
            if rpc_time <= now - wu.delay_bound:
                continue
            if self.rule == "users" and userid in users:
                continue
            if self.rule == "hosts" and hostid in hosts:
                continue
            return True
        return False


@dataclass(frozen=True)
class HostRow:
    """The columns of one ``host`` row boinc-dl uses."""

    id: int
    rpc_time: int
    p_ncpus: int
    p_fpops: float


@dataclass(frozen=True)
class HostAddressRow:
    """How a host row names itself: what a cloud instance is matched against."""

    id: int
    domain_name: str
    last_ip_addr: str
    external_ip_addr: str


@dataclass(frozen=True)
class InProgressRow:
    """A result in progress on a host: its name, its workunit's, and when it was sent."""

    result: str
    workunit: str
    hostid: int
    sent_time: int


@dataclass(frozen=True)
class ResultHost:
    """Who computed a result, by BOINC's account: the host and the user it belongs to
    (``result.hostid``, ``result.userid``, set by the scheduler when it sent the result)."""

    hostid: int
    userid: int


@dataclass(frozen=True)
class ResultTiming:
    """How long one returned result took, by BOINC's account: the host's elapsed (wall)
    and CPU seconds of the task as the client reported them, and the server's clock when
    the result was sent and received (whole seconds). Values are as stored: a host
    reports ``elapsed_time`` and ``cpu_time`` itself, so readers must bound them."""

    name: str
    workunit: str
    hostid: int
    outcome: int
    validate_state: int
    sent_time: float | None
    received_time: float | None
    elapsed_time: float | None
    cpu_time: float | None
    canonical: bool  # the workunit's canonical result (the one BOINC assimilated)


@dataclass(frozen=True)
class TrustReset:
    """A host app version whose ``consecutive_valid`` was set to 0: the host (from the
    result's row), the ``host_app_version.app_version_id`` (BOINC's generalized id) and
    the count before (None: the host has no ``host_app_version`` row, nothing to reset)."""

    hostid: int
    app_version_id: int
    before: int | None


def generalized_app_version_id(app_version_id: int, appid: int) -> int:
    """``host_app_version.app_version_id`` for a result's ``app_version_id``: the id itself,
    or for an anonymous-platform version (a negative id naming the resource type) the
    pseudo-id ``appid * 1000000 - app_version_id`` (``sched/sched_util.h``)."""
    return appid * 1_000_000 - app_version_id if app_version_id < 0 else app_version_id


@dataclass
class WorkunitState:
    """A workunit and its results, as BOINC sees them."""

    id: int
    name: str
    error_mask: int
    assimilate_state: int
    canonical_resultid: int
    delay_bound: int
    results: list[ResultRow] = field(default_factory=list)
    min_quorum: int = 1

    def result_back(self) -> bool:
        """A result was returned and not (yet) judged invalid: the unit is not lost,
        whatever happens next (validation, assimilation)."""
        if self.canonical_resultid or self.assimilate_state != ASSIMILATE_INIT:
            return True
        return any(r.server_state == RESULT_SERVER_STATE_OVER and r.outcome == RESULT_OUTCOME_SUCCESS
                   and r.validate_state != VALIDATE_STATE_INVALID for r in self.results)

    def in_flight(self, now: float) -> bool:
        """A sent result is still within its report deadline."""
        return any(r.server_state == RESULT_SERVER_STATE_IN_PROGRESS and r.report_deadline > now
                   for r in self.results)

    def overdue(self, now: float, takers: Takers | None = None) -> bool:
        """The unit is lost: no result back, and a sent result passed its report deadline
        or BOINC timed one out or saw it fail; or it is :meth:`stuck`. A workunit whose
        results were never sent (still queued in BOINC) is never overdue, nor one BOINC
        finished (error mask)."""
        if self.stuck(now, takers):
            return True
        if self.error_mask or self.result_back():
            return False
        lost = any((r.server_state == RESULT_SERVER_STATE_IN_PROGRESS and 0 < r.report_deadline <= now)
                   or (r.server_state == RESULT_SERVER_STATE_OVER and r.outcome in LOST_OUTCOMES)
                   for r in self.results)
        return lost and not self.in_flight(now)

    def stuck(self, now: float, takers: Takers | None = None) -> bool:
        """Results came back but the workunit cannot finish: none is in progress, the
        replica BOINC created last has waited unsent for longer than ``delay_bound`` (since
        it was created, and since the last result came back), and, where ``takers`` tells,
        no host seen within ``delay_bound`` may be sent it. Without ``takers`` (the hosts
        could not be read) the waits alone decide.

        Seen on a real server with two jobs sharing two hosts: a replica created with the
        workunit waited unsent while both hosts ran other jobs' work, and by its creation
        time alone it looked stuck 47 s after its sibling came back, although either host
        could still take it: the returned result was thrown away. Hence the host test.

        Seen on a real server with two hosts and ``min_quorum 2``: one replica judged
        invalid (or, once :meth:`undecided`, the set judged again and still undecided),
        and the replica BOINC then needs could go to neither host
        (``one_result_per_user_per_wu``, install's default, or ``one_result_per_host_per_wu``:
        each already had a result of the workunit), so
        the workunit waited for a third host forever with its other replica back. A
        regenerated unit is a new workunit that those hosts may take. A replica waits
        unsent at most about a unit's time in a fleet that can take it (the generator
        keeps a window of about the hosts' slots), so ``delay_bound`` (the unit's
        ``timeout_s`` plus the restart slack) never cuts a replica that would be sent."""
        if self.error_mask or self.canonical_resultid or self.assimilate_state != ASSIMILATE_INIT:
            return False
        if self.in_flight(now) or not any(r.server_state == RESULT_SERVER_STATE_OVER for r in self.results):
            return False
        unsent = [r.create_time for r in self.results if r.server_state == RESULT_SERVER_STATE_UNSENT]
        if not unsent:
            return False
        back = [r.received_time for r in self.results if r.server_state == RESULT_SERVER_STATE_OVER]
        if now - max(unsent + back) <= self.delay_bound:
            return False
        return takers is None or not takers.may_take(self, now)

    def undecided(self, now: float) -> bool:
        """The validator looked at a quorum of returned results and judged none of them:
        at least ``min_quorum`` results back successful, every one of them INCONCLUSIVE,
        none in progress, and the extra replica BOINC then asked for still unsent.

        What BOINC's validator leaves when it cannot judge a result (a transient error, as
        when boinc-dl's validator was killed: ``check_set`` in ``sched/validate_util2.cpp``
        counts it as not good, finds no consensus, marks the set inconclusive and raises
        ``target_nresults``, ``sched/validator.cpp``); the set is judged again only when
        that replica comes back, which a fleet of as many hosts as the quorum never sends.
        Two results that disagree look the same; judging them again costs one validator
        run and changes nothing."""
        if self.error_mask or self.canonical_resultid or self.assimilate_state != ASSIMILATE_INIT:
            return False
        if self.in_flight(now):
            return False
        back = [r for r in self.results if r.server_state == RESULT_SERVER_STATE_OVER
                and r.outcome == RESULT_OUTCOME_SUCCESS and r.validate_state != VALIDATE_STATE_INVALID]
        return (len(back) >= max(1, self.min_quorum)
                and all(r.validate_state == VALIDATE_STATE_INCONCLUSIVE for r in back)
                and any(r.server_state == RESULT_SERVER_STATE_UNSENT for r in self.results))

    def live(self) -> bool:
        """BOINC may still send or run an instance (worth cancelling)."""
        return self.error_mask == 0 and self.assimilate_state == ASSIMILATE_INIT


def like_prefix(prefix: str) -> str:
    """A ``LIKE`` pattern for names starting with ``prefix`` (its ``\\``, ``%`` and ``_``
    escaped: job names may contain ``_``, and unit names join the job with ``__``)."""
    return prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _opt_float(v: Any) -> float | None:
    """A column's number as a float (NULL: None); range checks are the reader's."""
    return None if v is None else float(v)


#: Database hosts that are this machine: no TLS for them (:func:`credentials`).
LOOPBACK = frozenset({"localhost", "127.0.0.1"})


def credentials(project: BoincProject) -> dict[str, Any]:
    """PyMySQL connection arguments from ``config.xml`` (without timeouts)."""
    cfg = project.config
    name = cfg.get("db_name")
    if not name:
        raise BoincDBError(f"{project.config_xml}: no <db_name>; boinc-dl cannot read BOINC's database")
    args: dict[str, Any] = {"database": name, "user": cfg.get("db_user") or "", "password": cfg.get("db_passwd") or ""}
    host = cfg.get("db_host") or "localhost"
    socket = cfg.get("db_socket")
    port = cfg.get("db_port")
    if ":" in host:
        host, _, port = host.partition(":")
    if socket:
        args["unix_socket"] = socket
    args["host"] = host
    if port:
        try:
            args["port"] = int(port)
        except ValueError:
            raise BoincDBError(f"{project.config_xml}: db_port {port!r} is not a number") from None
    if socket or host in LOOPBACK:
        # PyMySQL (>= 1.1) tries TLS on every connection unless told not to, and builds a
        # fresh SSL context with the system's CA store for each (tens of ms of CPU per
        # connection with a large store; the daemons connect every pass, each script call
        # once). On a Unix socket or loopback there is no network for TLS to protect.
        # Remote hosts keep PyMySQL's default.
        args["ssl_disabled"] = True
    return args


class BoincDB:
    """A connection to one project's database, read-only unless opened ``writable`` (for
    the ``consecutive_valid`` writes and :meth:`ask_revalidation` alone); use as a context manager or call
    :meth:`close`. Each method is one bounded query (chunked for long name lists)."""

    def __init__(self, project: BoincProject, timeout_s: float = 5.0, writable: bool = False):
        import pymysql

        self._pymysql = pymysql
        self.writable = writable
        args = credentials(project)
        try:
            self.conn = pymysql.connect(**args, connect_timeout=timeout_s, read_timeout=timeout_s,
                                        write_timeout=timeout_s, autocommit=True, charset="utf8mb4")
            if not writable:
                with self.conn.cursor() as c:
                    c.execute("SET SESSION TRANSACTION READ ONLY")
        except pymysql.MySQLError as e:
            where = args.get("unix_socket") or f"{args['host']}:{args.get('port', 3306)}"
            raise BoincDBError(f"cannot read BOINC's database {args['database']} at {where}: {e}") from None

    @classmethod
    def connect(cls, project: BoincProject, timeout_s: float = 5.0, writable: bool = False) -> BoincDB:
        """Open a session with the credentials of the project's config.xml (read-only
        unless ``writable``: only the ``consecutive_valid`` writes and
        :meth:`ask_revalidation` need that)."""
        return cls(project, timeout_s, writable)

    def __enter__(self) -> BoincDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:  # noqa: BLE001 - closing a dead connection is not an error
            pass

    def query(self, sql: str, params: Sequence[Any] = (), limit: int = MAX_ROWS) -> list[dict[str, Any]]:
        """Run one parametrized SELECT (``%s`` placeholders); at most ``limit`` rows."""
        if not sql.lstrip().lower().startswith("select"):
            raise BoincDBError("BoincDB runs SELECT statements only")
        try:
            with self.conn.cursor(self._pymysql.cursors.DictCursor) as c:
                c.execute(sql, tuple(params))
                return list(c.fetchmany(limit))
        except self._pymysql.MySQLError as e:
            raise BoincDBError(f"query on BOINC's database failed: {e}") from None

    def cap_consecutive_valid(self, result: str, cap: int) -> TrustReset | None:
        """Lower the ``consecutive_valid`` of result ``result``'s host app version to ``cap``
        if it is above: BOINC's scheduler then sends that host's jobs replicated with
        probability at least ``1 / cap`` (``set_trust``, ``sched/sched_send.cpp``). What it
        was before, as :meth:`reset_consecutive_valid` returns it (``before`` at or below
        the cap: nothing changed); None when BOINC has no such result sent to a host.
        Idempotent."""
        return self._set_consecutive_valid(result, int(cap))

    def reset_consecutive_valid(self, result: str) -> TrustReset | None:
        """What BOINC's validator does to the host of an invalid result (``is_invalid`` in
        ``sched/validator.cpp``): set the ``consecutive_valid`` of the result's host app
        version to 0, so that BOINC's scheduler replicates the host's next jobs until it
        earns its trust again (``set_trust``, ``sched/sched_send.cpp``). The host and app
        version come from BOINC's ``result`` row named ``result``; None when BOINC has no
        such result or it was never sent to a host. Idempotent: a second call sets 0 again.

        BOINC's ``is_invalid`` also lowers the row's ``max_jobs_per_day`` by one; that is
        left alone here, because a re-delivered result would lower it twice."""
        return self._set_consecutive_valid(result, 0)

    def _set_consecutive_valid(self, result: str, at_most: int) -> TrustReset | None:
        """Set ``consecutive_valid`` of ``result``'s host app version to ``at_most`` where it
        is above (see the two callers)."""
        if not self.writable:
            raise BoincDBError("changing consecutive_valid needs a session opened with writable=True")
        rows = self.query("SELECT hostid, appid, app_version_id FROM result WHERE name = %s", (result,), limit=1)
        if not rows or not int(rows[0]["hostid"] or 0):
            return None
        hostid = int(rows[0]["hostid"])
        avid = generalized_app_version_id(int(rows[0]["app_version_id"] or 0), int(rows[0]["appid"] or 0))
        # host_app_version's unique key is (host_id, app_version_id) (db/constraints.sql): one row.
        have = self.query("SELECT consecutive_valid FROM host_app_version WHERE host_id = %s AND app_version_id = %s",
                          (hostid, avid), limit=1)
        if not have:
            return TrustReset(hostid, avid, None)
        try:
            with self.conn.cursor() as c:
                c.execute("UPDATE host_app_version SET consecutive_valid = %s WHERE host_id = %s AND app_version_id = %s "
                          "AND consecutive_valid > %s", (at_most, hostid, avid, at_most))
        except self._pymysql.MySQLError as e:
            raise BoincDBError(f"update of BOINC's host_app_version failed: {e}") from None
        return TrustReset(hostid, avid, int(have[0]["consecutive_valid"]))

    def ask_revalidation(self, wu_id: int) -> bool:
        """Have BOINC's validator judge workunit ``wu_id``'s results again: set its
        ``need_validate``, as BOINC's ``html/ops/revalidate.php`` does (the validator's
        enumeration is ``need_validate > 0``), while the workunit still has no canonical
        result, no error and nothing assimilated. Its INCONCLUSIVE results are viable
        results to the validator as they are (only INVALID ones are left out), so nothing
        else changes. Whether the row was changed (False: the workunit was decided, gave
        up or is gone meanwhile). Repeating it asks for at most one more judgement."""
        if not self.writable:
            raise BoincDBError("asking for a revalidation needs a session opened with writable=True")
        try:
            with self.conn.cursor() as c:
                n = c.execute("UPDATE workunit SET need_validate = 1 WHERE id = %s AND canonical_resultid = 0 "
                              "AND error_mask = 0 AND assimilate_state = %s", (int(wu_id), ASSIMILATE_INIT))
        except self._pymysql.MySQLError as e:
            raise BoincDBError(f"update of BOINC's workunit failed: {e}") from None
        return bool(n)

    def workunits(self, names: Iterable[str]) -> dict[str, WorkunitState]:
        """Workunits by name, each with its results (names BOINC does not know are absent)."""
        names = list(dict.fromkeys(names))
        out: dict[str, WorkunitState] = {}
        by_id: dict[int, WorkunitState] = {}
        for i in range(0, len(names), CHUNK):
            chunk = names[i : i + CHUNK]
            marks = ",".join(["%s"] * len(chunk))
            # Only "%s" placeholders are formatted in; the values go as query parameters.
            for row in self.query("SELECT id, name, error_mask, assimilate_state, canonical_resultid, delay_bound, "
                                  f"min_quorum FROM workunit WHERE name IN ({marks})", chunk):  # nosec B608
                wu = WorkunitState(int(row["id"]), str(row["name"]), int(row["error_mask"]),
                                   int(row["assimilate_state"]), int(row["canonical_resultid"]),
                                   int(row["delay_bound"]), min_quorum=int(row["min_quorum"]))
                out[wu.name] = by_id[wu.id] = wu
        ids = list(by_id)
        for i in range(0, len(ids), CHUNK):
            chunk = ids[i : i + CHUNK]
            marks = ",".join(["%s"] * len(chunk))
            # Only "%s" placeholders are formatted in; the values go as query parameters.
            for row in self.query("SELECT id, workunitid, name, server_state, outcome, validate_state, sent_time, "  # nosec B608
                                  "report_deadline, received_time, hostid, create_time, userid FROM result "
                                  f"WHERE workunitid IN ({marks}) ORDER BY id", chunk):
                by_id[int(row["workunitid"])].results.append(ResultRow(
                    int(row["id"]), str(row["name"]), int(row["server_state"]), int(row["outcome"]),
                    int(row["validate_state"]), int(row["sent_time"]), int(row["report_deadline"]),
                    int(row["received_time"]), int(row["hostid"]), int(row["create_time"]), int(row["userid"])))
        return out

    def result_hosts(self, names: Iterable[str]) -> dict[str, ResultHost]:
        """The host and user of each named result (names BOINC does not know are absent)."""
        names = list(dict.fromkeys(names))
        out: dict[str, ResultHost] = {}
        for i in range(0, len(names), CHUNK):
            chunk = names[i : i + CHUNK]
            marks = ",".join(["%s"] * len(chunk))
            # Only "%s" placeholders are formatted in; the values go as query parameters.
            for row in self.query(f"SELECT name, hostid, userid FROM result WHERE name IN ({marks})",  # nosec B608
                                  chunk):
                out[str(row["name"])] = ResultHost(int(row["hostid"]), int(row["userid"]))
        return out

    def app_exists(self, name: str) -> bool:
        """Whether ``bin/xadd`` put app ``name`` into the ``app`` table."""
        return bool(self.query("SELECT id FROM app WHERE name = %s", (name,), limit=1))

    def platform_names(self) -> set[str]:
        """Names of the platforms in the ``platform`` table."""
        return {str(r["name"]) for r in self.query("SELECT name FROM platform", limit=10_000)}

    def app_versions(self, app: str) -> set[tuple[int, str, str]]:
        """(version_num, platform name, plan class) of app ``app``'s versions, as
        ``bin/update_versions`` registered them (``app_version`` joined with ``platform``)."""
        rows = self.query("SELECT av.version_num, p.name AS platform, av.plan_class FROM app_version av "
                          "JOIN app a ON a.id = av.appid JOIN platform p ON p.id = av.platformid "
                          "WHERE a.name = %s AND av.deprecated = 0", (app,), limit=10_000)
        return {(int(r["version_num"]), str(r["platform"]), str(r["plan_class"] or "")) for r in rows}

    def workunit_name(self, wu_id: int) -> str | None:
        """A workunit's name by id (release 1.2's ``--error`` calls pass only the id)."""
        rows = self.query("SELECT name FROM workunit WHERE id = %s", (int(wu_id),), limit=1)
        return str(rows[0]["name"]) if rows else None

    def job_task_costs(self, wu_prefix: str, limit: int = 200) -> list[tuple[float, float]]:
        """(elapsed_time, flops_estimate) of the latest successful results of the workunits
        whose names start with ``wu_prefix``: what a task of the job really costs.
        ``flops_estimate`` is the speed the scheduler assumed for the host when it sent the
        result (``sched/sched_send.cpp``), so their product is the task's size in BOINC's
        own unit, the one ``rsc_fpops_est`` is divided by to predict a runtime."""
        like = wu_prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        rows = self.query("SELECT r.elapsed_time, r.flops_estimate FROM result r JOIN workunit w "
                          "ON w.id = r.workunitid WHERE w.name LIKE %s AND r.outcome = %s "
                          "AND r.elapsed_time > 0 AND r.flops_estimate > 0 ORDER BY r.id DESC LIMIT %s",
                          (like, RESULT_OUTCOME_SUCCESS, int(limit)), limit=limit)
        return [(float(r["elapsed_time"]), float(r["flops_estimate"])) for r in rows]

    def job_result_timings(self, wu_prefix: str, limit: int = 20_000) -> list[ResultTiming]:
        """The returned results (``server_state`` over, any outcome) of the workunits whose
        names start with ``wu_prefix``, newest first, at most ``limit``: their hosts,
        outcomes and times (elapsed, CPU, sent, received). One query on the ``workunit``
        name index (a ``LIKE 'prefix%'``), joined to ``result`` by its ``workunitid`` key."""
        rows = self.query("SELECT r.name, w.name AS workunit, r.hostid, r.outcome, r.validate_state, r.sent_time, "
                          "r.received_time, r.elapsed_time, r.cpu_time, (w.canonical_resultid = r.id) AS canonical "
                          "FROM result r JOIN workunit w ON w.id = r.workunitid "
                          "WHERE w.name LIKE %s AND r.server_state = %s ORDER BY r.id DESC LIMIT %s",
                          (like_prefix(wu_prefix), RESULT_SERVER_STATE_OVER, int(limit)), limit=limit)
        return [ResultTiming(str(r["name"]), str(r["workunit"]), int(r["hostid"] or 0), int(r["outcome"] or 0),
                             int(r["validate_state"] or 0), _opt_float(r["sent_time"]),
                             _opt_float(r["received_time"]), _opt_float(r["elapsed_time"]),
                             _opt_float(r["cpu_time"]), bool(r["canonical"])) for r in rows]

    def active_hosts(self, active_within_s: float = 86400.0) -> list[HostRow]:
        """Hosts that contacted the scheduler within ``active_within_s``, with their
        CPU count and benchmarked speed (``host`` table)."""
        rows = self.query("SELECT id, rpc_time, p_ncpus, p_fpops FROM host WHERE rpc_time > UNIX_TIMESTAMP() - %s "
                          "ORDER BY id", (float(active_within_s),), limit=100_000)
        return [HostRow(int(r["id"]), int(r["rpc_time"]), int(r["p_ncpus"]), float(r["p_fpops"])) for r in rows]

    def recent_hosts(self, active_within_s: float) -> list[tuple[int, int, int]]:
        """``(hostid, userid, rpc_time)`` of the hosts that contacted the scheduler within
        ``active_within_s`` (who could take a replica: :class:`Takers`)."""
        rows = self.query("SELECT id, userid, rpc_time FROM host WHERE rpc_time > UNIX_TIMESTAMP() - %s ORDER BY id",
                          (float(active_within_s),), limit=100_000)
        return [(int(r["id"]), int(r["userid"]), int(r["rpc_time"])) for r in rows]

    def host_fpops(self, active_within_s: float = 86400.0) -> list[float]:
        """Benchmarked floating-point speed (``host.p_fpops``) of the hosts that contacted
        the scheduler recently: what BOINC divides ``rsc_fpops_est`` by for a new app."""
        rows = self.query("SELECT p_fpops FROM host WHERE rpc_time > UNIX_TIMESTAMP() - %s AND p_fpops > 0",
                          (float(active_within_s),), limit=10_000)
        return [float(r["p_fpops"]) for r in rows]

    # ---- what the fleet controller reads (server/fleet/boinchosts.py) ----------------------
    def hosts_named(self, names: Iterable[str], ips: Iterable[str]) -> list[HostAddressRow]:
        """Host rows whose ``domain_name`` is one of ``names`` or whose last or external
        IP address is one of ``ips`` (each list chunked)."""
        out: dict[int, HostAddressRow] = {}
        for column_sets, values in ((("domain_name",), sorted(set(names))),
                                    (("last_ip_addr", "external_ip_addr"), sorted(set(ips)))):
            for i in range(0, len(values), CHUNK):
                chunk = values[i : i + CHUNK]
                marks = ",".join(["%s"] * len(chunk))
                where = " OR ".join(f"{col} IN ({marks})" for col in column_sets)
                # Only fixed column names and "%s" placeholders are formatted in.
                for row in self.query("SELECT id, domain_name, last_ip_addr, external_ip_addr FROM host "  # nosec B608
                                      f"WHERE {where}", chunk * len(column_sets)):
                    out[int(row["id"])] = HostAddressRow(int(row["id"]), str(row["domain_name"] or ""),
                                                         str(row["last_ip_addr"] or ""),
                                                         str(row["external_ip_addr"] or ""))
        return [out[k] for k in sorted(out)]

    def results_in_progress(self, app: str, host_ids: Iterable[int]) -> list[InProgressRow]:
        """Results of ``app`` in progress (sent, not back) on these hosts."""
        ids = sorted({int(h) for h in host_ids})
        out: list[InProgressRow] = []
        for i in range(0, len(ids), CHUNK):
            chunk = ids[i : i + CHUNK]
            marks = ",".join(["%s"] * len(chunk))
            # Only "%s" placeholders are formatted in; the values go as query parameters.
            for row in self.query("SELECT r.name AS result, w.name AS workunit, r.hostid, r.sent_time "  # nosec B608
                                  "FROM result r JOIN workunit w ON r.workunitid = w.id JOIN app a ON r.appid = a.id "
                                  f"WHERE a.name = %s AND r.server_state = %s AND r.hostid IN ({marks}) "
                                  "ORDER BY r.id", [app, RESULT_SERVER_STATE_IN_PROGRESS, *chunk]):
                out.append(InProgressRow(str(row["result"]), str(row["workunit"]), int(row["hostid"]),
                                         int(row["sent_time"] or 0)))
        return out

    def result_counts(self, app: str) -> dict[int, int]:
        """Results of ``app`` unsent and in progress, by ``server_state``."""
        rows = self.query("SELECT r.server_state, COUNT(*) AS n FROM result r JOIN app a ON r.appid = a.id "
                          "WHERE a.name = %s AND r.server_state IN (%s, %s) GROUP BY r.server_state",
                          (app, RESULT_SERVER_STATE_UNSENT, RESULT_SERVER_STATE_IN_PROGRESS), limit=10)
        return {int(r["server_state"]): int(r["n"]) for r in rows}

    def workunits_in_progress(self, app: str) -> list[str]:
        """Workunit names of ``app``'s results in progress (one per result)."""
        rows = self.query("SELECT w.name FROM result r JOIN workunit w ON r.workunitid = w.id "
                          "JOIN app a ON r.appid = a.id WHERE a.name = %s AND r.server_state = %s",
                          (app, RESULT_SERVER_STATE_IN_PROGRESS))
        return [str(r["name"]) for r in rows]
