"""BOINC's server-side daemons as the tests play them, on the fake project's MariaDB.

Test doubles, not BOINC code, following what BOINC's daemons do to the columns
boinc-dl reads (``db/boinc_db_types.h`` for the values):

* :func:`send`: the scheduler hands an UNSENT result to a host (``sched/sched_send.cpp``:
  ``sent_time = now``, ``report_deadline = sent_time + delay_bound``), in any order,
  never a second result of a workunit to the same user or host when config.xml's
  ``<one_result_per_user_per_wu>`` / ``<one_result_per_host_per_wu>`` say so
  (``slow_check``, ``sched/sched_check.cpp``: the user rule first, then the host rule).
* :func:`request_work`: a host's work request (recorded in its ``host`` row: ``rpc_time``): UNSENT results in the job cache's order,
  at most ``max_wus_to_send`` x CPUs per reply (``WORK_REQ::get_job_limits``), and at
  most the per-app cap of ``config_aux.xml``'s ``<max_jobs_in_progress>`` (``jobs`` x
  CPUs with ``<per_proc/>``), counting the host's tasks in progress
  (``sched/sched_limit.h``).
* :func:`scheduler_reply_delay`: while ``stop_sched`` exists (``bin/stop`` writes it,
  ``bin/start`` removes it), every request is answered "project down" with a
  ``request_delay`` of config.xml's ``<maintenance_delay>`` (3600 when unset,
  ``sched/sched_main.cpp``); otherwise the ``request_delay`` of ``min_sendwork_interval``.
* adaptive replication (:func:`send`, ``sched/sched_send.cpp``): a workunit of target
  1 of an app whose ``target_nresults`` is above 1 is sent unreplicated only to a host
  app version BOINC trusts (``set_trust``: at least 10 ``consecutive_valid``, then with
  probability ``1 - 1/consecutive_valid``); otherwise its ``target_nresults`` and
  ``min_quorum`` become the app's and the transitioner adds the replicas.
* :func:`report`: the host reports; success waits for the validator, an error is over.
* :func:`validate`: the validator marks the result valid, the workunit gets its
  canonical result and becomes ready to assimilate; :func:`assimilated` marks it done.
  A valid result of a replicated workunit adds one to its host app version's
  ``consecutive_valid``, an invalid one (:func:`judge`) sets it to 0 (``is_valid`` and
  ``is_invalid``, ``sched/validator.cpp``).
* :func:`validate_set`: the validator on a workunit without a canonical result, as a
  set (``handle_wu``, ``sched/validator.cpp``; ``check_set``, ``sched/validate_util2.cpp``):
  a result it cannot judge (transient) is not good, and with fewer good results than the
  quorum every viable one becomes INCONCLUSIVE and ``target_nresults`` is raised for one
  more replica; :func:`validator_pass` judges the workunits with ``need_validate`` set
  (the validator's enumeration), as ``html/ops/revalidate.php`` leaves them.
* :func:`time_out`: the transitioner times out results past their deadline
  (``NO_REPLY``) and creates a new UNSENT instance (``sched/transitioner.cpp``).
* :func:`file_deleter`: removes the input files (not ``<no_delete/>``) and uploaded outputs
  of workunits BOINC considers finished: assimilated, or with an error mask
  (cancelled ones included) (``sched/file_deleter.cpp``).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from boinc_dl.server.backends.boinc.project import BoincProject, dir_hier_path


def _conn(project: BoincProject):  # noqa: ANN202
    import sys

    fakes = str(Path(__file__).resolve().parent / "fake_tools")
    if fakes not in sys.path:
        sys.path.append(fakes)
    import _fakemysql

    return _fakemysql.connect(project.root)


def rows(project: BoincProject, sql: str, params: tuple = ()) -> list[dict]:
    conn = _conn(project)
    with conn.cursor() as c:
        c.execute(sql, params)
        out = list(c.fetchall())
    conn.close()
    return out


def _exec(project: BoincProject, sql: str, params: tuple = ()) -> int:
    conn = _conn(project)
    with conn.cursor() as c:
        n = c.execute(sql, params)
    conn.close()
    return n


def _config_flag(project: BoincProject, tag: str) -> bool:
    """A config.xml flag as BOINC's parse_bool reads it (``<tag/>`` or a non-zero number)."""
    import xml.etree.ElementTree as ET

    el = ET.parse(project.config_xml).getroot().find(f"config/{tag}")
    if el is None:
        return False
    text = (el.text or "").strip()
    return True if not text else text.isdigit() and int(text) != 0


def _config_number(project: BoincProject, tag: str, default: float) -> float:
    import xml.etree.ElementTree as ET

    el = ET.parse(project.config_xml).getroot().find(f"config/{tag}")
    try:
        return float((el.text or "").strip()) if el is not None else default
    except ValueError:
        return default


def _already_has(project: BoincProject, wu_id: int, hostid: int, userid: int) -> bool:
    """slow_check: the user rule, else the host rule, when config.xml asks for one."""
    if _config_flag(project, "one_result_per_user_per_wu"):
        col, val = "userid", userid
    elif _config_flag(project, "one_result_per_host_per_wu"):
        col, val = "hostid", hostid
    else:
        return False
    n = rows(project, f"SELECT COUNT(*) AS n FROM result WHERE workunitid = %s AND server_state >= 4 AND {col} = %s",
             (wu_id, val))[0]["n"]
    return n > 0


#: ``CONS_VALID_UNREPLICATED`` (``sched/sched_config.h``).
CONS_VALID_UNREPLICATED = 10


def gavid(app_version_id: int, appid: int) -> int:
    """``host_app_version.app_version_id`` of a result (``generalized_app_version_id``,
    ``sched/sched_util.h``): anonymous-platform versions (negative) get a pseudo-id."""
    return appid * 1_000_000 - app_version_id if app_version_id < 0 else app_version_id


def trusted(project: BoincProject, hostid: int, app_version_id: int, appid: int = 1,
            rng: random.Random | None = None) -> bool:
    """``set_trust``: whether the scheduler sends this host app version unreplicated work."""
    r = rows(project, "SELECT consecutive_valid FROM host_app_version WHERE host_id = %s AND app_version_id = %s",
             (hostid, gavid(app_version_id, appid)))
    n = int(r[0]["consecutive_valid"]) if r else 0
    if n < CONS_VALID_UNREPLICATED:
        return False
    return (rng or random).random() > 1.0 / n


def _new_instance(project: BoincProject, wu_id: int, name: str, priority: int, now: int, appid: int = 1) -> None:
    """An UNSENT result the transitioner creates for a workunit; it inherits the
    workunit's priority (``create_result_ti``, ``tools/backend_lib.cpp``)."""
    _exec(project, "INSERT INTO result (create_time, workunitid, server_state, appid, name, priority) "
                   "VALUES (%s, %s, 2, %s, %s, %s)", (now, wu_id, appid, name, priority))


def _replicate_if_untrusted(project: BoincProject, wu_id: int, hostid: int, app_version_id: int, now: int,
                            rng: random.Random | None) -> None:
    """Adaptive replication when a result is sent (``sched/sched_send.cpp``), and the
    transitioner's pass that creates the replicas the new target asks for."""
    w = rows(project, "SELECT w.name, w.appid, w.priority, w.target_nresults, a.target_nresults AS app_target "
                      "FROM workunit w "
                      "JOIN app a ON a.id = w.appid WHERE w.id = %s", (wu_id,))
    if not w or not (int(w[0]["target_nresults"]) == 1 and int(w[0]["app_target"]) > 1):
        return
    if trusted(project, hostid, app_version_id, int(w[0]["appid"]), rng):
        return
    target = int(w[0]["app_target"])
    _exec(project, "UPDATE workunit SET target_nresults = %s, min_quorum = %s, transition_time = %s WHERE id = %s",
          (target, target, now, wu_id))
    n = rows(project, "SELECT COUNT(*) AS n FROM result WHERE workunitid = %s", (wu_id,))[0]["n"]
    for i in range(n, target):
        _new_instance(project, wu_id, f"{w[0]['name']}_{i}", int(w[0]["priority"]), now, int(w[0]["appid"]))


def _count_validation(project: BoincProject, result_id: int, valid: bool) -> None:
    """The validator's update of the result's host app version (``is_valid``: one more
    consecutive valid result when the workunit was replicated; ``is_invalid``: 0)."""
    r = rows(project, "SELECT r.hostid, r.appid, r.app_version_id, w.target_nresults, a.target_nresults AS app_target "
                      "FROM result r JOIN workunit w ON w.id = r.workunitid LEFT JOIN app a ON a.id = w.appid "
                      "WHERE r.id = %s", (result_id,))
    if not r:
        return
    x = r[0]
    key = (int(x["hostid"]), gavid(int(x["app_version_id"]), int(x["appid"])))
    if not valid:
        _exec(project, "UPDATE host_app_version SET consecutive_valid = 0 WHERE host_id = %s AND app_version_id = %s",
              key)
    elif not (int(x["target_nresults"]) == 1 and int(x["app_target"] or 0) > 1):  # not is_unreplicated(wu)
        _exec(project, "UPDATE host_app_version SET consecutive_valid = consecutive_valid + 1 "
                       "WHERE host_id = %s AND app_version_id = %s", key)


def send(project: BoincProject, wu_names: list[str], hostid: int = 1, now: float | None = None,
         flops: float = 4e9, userid: int | None = None, app_version_id: int = 0,
         rng: random.Random | None = None) -> list[str]:
    """Send one UNSENT result of each named workunit (in the order given), to a host the
    scheduler believes does ``flops`` per second, of user ``userid`` (default: a user of
    its own, ``hostid``), to run app version ``app_version_id`` (as the scheduler records
    it: an ``app_version`` id, or for an anonymous-platform host a negative number naming
    the resource type); the results' names. A workunit of which config.xml forbids this
    host or user a second result is skipped; one of an app with adaptive replication goes
    out replicated unless the host app version is trusted (``rng`` draws the spot check)."""
    now = int(now if now is not None else time.time())
    userid = hostid if userid is None else userid
    sent = []
    for wu in wu_names:
        r = rows(project, "SELECT r.id, r.name, r.workunitid, w.delay_bound FROM result r JOIN workunit w "
                          "ON w.id = r.workunitid WHERE w.name = %s AND r.server_state = 2 AND w.error_mask = 0 "
                          "ORDER BY r.id LIMIT 1", (wu,))
        if not r or _already_has(project, int(r[0]["workunitid"]), hostid, userid):
            continue
        _exec(project, "UPDATE result SET server_state = 4, sent_time = %s, report_deadline = %s, hostid = %s, "
                       "userid = %s, flops_estimate = %s, app_version_id = %s WHERE id = %s",
              (now, now + int(r[0]["delay_bound"]), hostid, userid, flops, app_version_id, r[0]["id"]))
        _replicate_if_untrusted(project, int(r[0]["workunitid"]), hostid, app_version_id, now, rng)
        sent.append(r[0]["name"])
    return sent


def jobs_cap(project: BoincProject, ncpus: int, app: str = "boincdl") -> int | None:
    """The per-host cap on ``app``'s CPU tasks in progress from config_aux.xml (None: none)."""
    import xml.etree.ElementTree as ET

    path = project.root / "config_aux.xml"
    if not path.exists():
        return None
    for a in ET.parse(path).getroot().findall("max_jobs_in_progress/app"):
        if (a.findtext("app_name") or "").strip() != app:
            continue
        lim = a.find("cpu_limit")
        if lim is None:
            continue
        jobs = int((lim.findtext("jobs") or "0").strip() or 0)
        if jobs:
            return jobs * ncpus if lim.find("per_proc") is not None else jobs
    return None


def request_work(project: BoincProject, hostid: int, ncpus: int, n_wanted: int, in_progress: int = 0,
                 now: float | None = None, userid: int | None = None) -> list[str]:
    """A host with ``ncpus`` CPUs and ``in_progress`` boincdl tasks asks for ``n_wanted``
    more: the scheduler sends UNSENT results by score within its limits; the names sent.

    The score is the result's priority (``JOB::get_score``, ``sched/sched_score.cpp``: 0
    plus ``res_priority`` with no size classes, keywords or ``batch_accel``), highest
    first (``std::sort`` of the jobs scanned from a random slot, ``send_work_score_type``).
    BOINC leaves the order of equal scores to that unstable sort; on a real server new
    results won most ties (the feeder refills the slots freed by sent ones), so the fake
    takes the newest first among equals: the worst case for a unit left waiting, never
    the creation order that would hide it."""
    # every scheduler RPC updates the host's row (``rpc_time``; the scheduler creates the
    # row on a host's first RPC, ``sched/handle_request.cpp``)
    t = int(now if now is not None else time.time())
    _exec(project, "INSERT INTO host (id, create_time, rpc_time, userid, p_ncpus) VALUES (%s, %s, %s, %s, %s) "
                   "ON DUPLICATE KEY UPDATE rpc_time = VALUES(rpc_time)",
          (hostid, t, t, hostid if userid is None else userid, ncpus))
    per_rpc = int(_config_number(project, "max_wus_to_send", 10)) * ncpus
    cap = jobs_cap(project, ncpus)
    room = min(n_wanted, per_rpc, (cap - in_progress) if cap is not None else n_wanted)
    sent: list[str] = []
    if room <= 0:
        return sent
    for w in rows(project, "SELECT w.name, MAX(r.priority) AS p, MAX(r.id) AS newest FROM result r "
                           "JOIN workunit w ON w.id = r.workunitid WHERE r.server_state = 2 AND w.error_mask = 0 "
                           "GROUP BY w.id, w.name ORDER BY p DESC, newest DESC"):
        sent += send(project, [w["name"]], hostid, now, userid=userid)
        if len(sent) >= room:
            break
    return sent


#: A client's longest wait after one failed scheduler RPC: ``project_rpc_backoff``
#: (``client/scheduler_op.cpp``) defers it SCHED_RETRY_DELAY_MIN (60 s) x 2^1 x U[0.5, 1).
CLIENT_FIRST_BACKOFF_MAX_S = 120.0


def client_wait_after_reply(project: BoincProject) -> float:
    """How long a client that asks now may wait before its next RPC: a "project down"
    reply is an RPC failure for the client (``ERR_PROJECT_DOWN``), so it waits the
    longer of the reply's ``request_delay`` and its own first-failure backoff."""
    delay = scheduler_reply_delay(project)
    if (project.root / "stop_sched").exists():
        return max(delay, CLIENT_FIRST_BACKOFF_MAX_S)
    return delay


def scheduler_reply_delay(project: BoincProject) -> float:
    """The ``request_delay`` of the reply a host gets now: ``maintenance_delay`` while the
    project is down (``stop_sched``), else that of ``min_sendwork_interval``."""
    if (project.root / "stop_sched").exists():
        return _config_number(project, "maintenance_delay", 3600.0)
    msi = _config_number(project, "min_sendwork_interval", 0.0)
    return max(1.01 * msi, msi + 1) if msi > 0 else 0.0


def report(project: BoincProject, result: str, success: bool = True, now: float | None = None,
           elapsed_s: float = 0.0, cpu_s: float = 0.0) -> None:
    """The host reports the result after ``elapsed_s`` of run time and ``cpu_s`` of CPU
    time (a late report is accepted, as BOINC does)."""
    now = int(now if now is not None else time.time())
    _exec(project, "UPDATE result SET server_state = 5, outcome = %s, received_time = %s, validate_state = 0, "
                   "elapsed_time = %s, cpu_time = %s WHERE name = %s",
          (1 if success else 3, now, elapsed_s, cpu_s, result))


def validate(project: BoincProject, result: str) -> None:
    """The result is valid and canonical; the workunit is ready for the assimilator."""
    r = rows(project, "SELECT id, workunitid FROM result WHERE name = %s", (result,))[0]
    _exec(project, "UPDATE result SET validate_state = 1 WHERE id = %s", (r["id"],))
    _count_validation(project, int(r["id"]), valid=True)
    _exec(project, "UPDATE workunit SET canonical_resultid = %s, assimilate_state = 1 WHERE id = %s "
                   "AND canonical_resultid = 0", (r["id"], r["workunitid"]))


def assimilated(project: BoincProject, wu: str) -> None:
    _exec(project, "UPDATE workunit SET assimilate_state = 2 WHERE name = %s", (wu,))


def time_out(project: BoincProject, now: float | None = None) -> list[str]:
    """Results past their report deadline become NO_REPLY and each gets a new UNSENT
    instance within max_total_results; the names of the timed-out results."""
    now = int(now if now is not None else time.time())
    late = rows(project, "SELECT r.id, r.name, r.workunitid, w.name AS wu, w.max_total_results, w.priority "
                         "FROM result r "
                         "JOIN workunit w ON w.id = r.workunitid WHERE r.server_state = 4 AND r.report_deadline < %s",
                (now,))
    for r in late:
        _exec(project, "UPDATE result SET server_state = 5, outcome = 4 WHERE id = %s", (r["id"],))
        n = rows(project, "SELECT COUNT(*) AS n FROM result WHERE workunitid = %s", (r["workunitid"],))[0]["n"]
        if n < r["max_total_results"]:
            _new_instance(project, int(r["workunitid"]), f"{r['wu']}_{n}", int(r["priority"]), now)
    return [r["name"] for r in late]


def live_workunits(project: BoincProject) -> list[str]:
    """Workunits BOINC may still send or run: no error mask, not assimilated."""
    return [r["name"] for r in rows(project, "SELECT name FROM workunit WHERE error_mask = 0 "
                                             "AND assimilate_state < 2 ORDER BY id")]


def file_deleter(project: BoincProject, wu_infiles: dict[str, list[str]]) -> list[Path]:
    """Remove the per-unit input (``wu.json``, the only one without ``<no_delete/>``) and
    the uploaded outputs of every finished workunit; the paths removed."""
    done = rows(project, "SELECT id, name FROM workunit WHERE (assimilate_state = 2 OR error_mask <> 0) "
                         "AND file_delete_state = 0")
    removed: list[Path] = []
    for wu in done:
        files = [dir_hier_path(f, project.download_dir, project.fanout) for f in wu_infiles.get(wu["name"], [])[-1:]]
        for res in rows(project, "SELECT name FROM result WHERE workunitid = %s", (wu["id"],)):
            files += [p for p in project.upload_dir.glob(f"*/{res['name']}_r*_*")]
        for f in files:
            if f.exists():
                f.unlink()
                removed.append(f)
        _exec(project, "UPDATE workunit SET file_delete_state = 2 WHERE id = %s", (wu["id"],))
    return removed


def _replace_results(project: BoincProject, result_id: int) -> list[str]:
    """The transitioner's pass after a result failed validation (:func:`_transition`)."""
    wu_id = rows(project, "SELECT workunitid FROM result WHERE id = %s", (result_id,))[0]["workunitid"]
    return _transition(project, int(wu_id))


def _transition(project: BoincProject, wu_id: int) -> list[str]:
    """The transitioner's pass on a workunit (``sched/transitioner.cpp``): as many new
    UNSENT instances as it is short of ``target_nresults`` results still counting (sent,
    unsent, or back and not invalid), within ``max_total_results``; each with the
    workunit's priority. Their names."""
    w = rows(project, "SELECT id, name, priority, target_nresults, max_total_results FROM workunit WHERE id = %s",
             (wu_id,))[0]
    res = rows(project, "SELECT server_state, outcome, validate_state FROM result WHERE workunitid = %s", (w["id"],))
    counting = sum(1 for x in res if x["server_state"] in (2, 4)
                   or (x["server_state"] == 5 and x["outcome"] == 1 and x["validate_state"] != 2))
    names = []
    for n in range(len(res), min(len(res) + max(0, int(w["target_nresults"]) - counting), int(w["max_total_results"]))):
        names.append(f"{w['name']}_{n}")
        _new_instance(project, int(w["id"]), names[-1], int(w["priority"]), int(time.time()))
    return names


def judge(project: BoincProject, result: str, init_exit: int) -> tuple[int, int]:
    """A reported result through BOINC's transitioner and ``script_validator`` when its init
    script exits ``init_exit``; the result's (outcome, validate_state) afterwards.

    * the transitioner's pass (``sched/transitioner.cpp``): a successful result still
      INIT of a workunit with an error mask (a cancelled one) becomes NO_CHECK (3);
    * the validator (``init_result`` in ``sched/script_validator.cpp``, ``check_set`` in
      ``sched/validate_util2.cpp``): 0 is valid (1); 3, VAL_RESULT_TRANSIENT_ERROR,
      leaves the result as it is; anything else is outcome VALIDATE_ERROR (6),
      validate_state INVALID (2), a mark against the host, and the transitioner's
      replacement instance (:func:`_replace_results`).
    """
    r = rows(project, "SELECT r.id, r.validate_state, w.error_mask FROM result r JOIN workunit w "
                      "ON w.id = r.workunitid WHERE r.name = %s", (result,))[0]
    if r["error_mask"] and r["validate_state"] == 0:
        _exec(project, "UPDATE result SET validate_state = 3 WHERE id = %s", (r["id"],))
    if init_exit == 0:
        _exec(project, "UPDATE result SET validate_state = 1 WHERE id = %s", (r["id"],))
        _count_validation(project, int(r["id"]), valid=True)
    elif init_exit != 3:
        _exec(project, "UPDATE result SET outcome = 6, validate_state = 2 WHERE id = %s", (r["id"],))
        _count_validation(project, int(r["id"]), valid=False)
        _replace_results(project, int(r["id"]))
    out = rows(project, "SELECT outcome, validate_state FROM result WHERE id = %s", (r["id"],))[0]
    return int(out["outcome"]), int(out["validate_state"])


def validate_set(project: BoincProject, wu: str, init_exits: dict[str, int] | None = None,
                 agree: bool = True) -> str | None:
    """BOINC's validator on workunit ``wu`` while it has no canonical result (``handle_wu``,
    ``sched/validator.cpp``; ``check_set``, ``sched/validate_util2.cpp``); the canonical
    result's name, or None.

    The viable results are those back successful and not INVALID (INCONCLUSIVE ones
    included); with fewer than ``min_quorum`` nothing happens. Each viable result's init
    script exits ``init_exits[name]`` (0 when absent): 0 is a good result, 3
    (VAL_RESULT_TRANSIENT_ERROR) is not good and not judged, anything else is outcome
    VALIDATE_ERROR and INVALID. With a quorum of good results that ``agree``, they are
    VALID, the first is canonical, the workunit is ready to assimilate, and its unsent
    results are not needed (OVER, DIDNT_NEED). Otherwise no consensus: every viable
    result still INIT becomes INCONCLUSIVE, and when the viable results are as many as
    ``target_nresults`` it is raised by one; the transitioner then adds the replicas
    (:func:`_transition`). ``need_validate`` is cleared either way."""
    w = rows(project, "SELECT id, min_quorum, target_nresults FROM workunit WHERE name = %s", (wu,))[0]
    wu_id, quorum = int(w["id"]), int(w["min_quorum"])
    _exec(project, "UPDATE workunit SET need_validate = 0 WHERE id = %s", (wu_id,))
    res = rows(project, "SELECT id, name, validate_state FROM result WHERE workunitid = %s AND server_state = 5 "
                        "AND outcome = 1 AND validate_state <> 2 ORDER BY id", (wu_id,))
    if len(res) < quorum:
        return None
    exits = init_exits or {}
    good, viable = [], []
    for r in res:
        code = exits.get(r["name"], 0)
        if code == 0:
            good.append(r)
        if code in (0, 3):
            viable.append(r)
        else:
            _exec(project, "UPDATE result SET outcome = 6, validate_state = 2 WHERE id = %s", (r["id"],))
            _count_validation(project, int(r["id"]), valid=False)
    if len(good) >= quorum and agree:
        for r in good:
            _exec(project, "UPDATE result SET validate_state = 1 WHERE id = %s", (r["id"],))
            _count_validation(project, int(r["id"]), valid=True)
        _exec(project, "UPDATE workunit SET canonical_resultid = %s, assimilate_state = 1 WHERE id = %s",
              (good[0]["id"], wu_id))
        _exec(project, "UPDATE result SET server_state = 5, outcome = 5 WHERE workunitid = %s AND server_state = 2",
              (wu_id,))
        return str(good[0]["name"])
    for r in viable:
        if int(r["validate_state"]) == 0:
            _exec(project, "UPDATE result SET validate_state = 4 WHERE id = %s", (r["id"],))
    if len(viable) >= int(w["target_nresults"]):
        _exec(project, "UPDATE workunit SET target_nresults = %s WHERE id = %s", (len(viable) + 1, wu_id))
    _transition(project, wu_id)
    return None


def validator_pass(project: BoincProject, init_exits: dict[str, int] | None = None,
                   agree: bool = True) -> list[str]:
    """One pass of BOINC's validator: :func:`validate_set` on every workunit with
    ``need_validate > 0`` (its enumeration, ``db/boinc_db.cpp``); the canonical results found."""
    out = []
    for w in rows(project, "SELECT name FROM workunit WHERE need_validate > 0 ORDER BY id"):
        found = validate_set(project, str(w["name"]), init_exits, agree)
        if found:
            out.append(found)
    return out
