"""BOINC's server-side daemons as the tests play them, on the fake project's MariaDB.

Test doubles, not BOINC code, following what BOINC's daemons do to the columns
boinc-dl reads (``db/boinc_db_types.h`` for the values):

* :func:`send`: the scheduler hands an UNSENT result to a host (``sched/sched_send.cpp``:
  ``sent_time = now``, ``report_deadline = sent_time + delay_bound``), in any order.
* :func:`report`: the host reports; success waits for the validator, an error is over.
* :func:`validate`: the validator marks the result valid, the workunit gets its
  canonical result and becomes ready to assimilate; :func:`assimilated` marks it done.
* :func:`time_out`: the transitioner times out results past their deadline
  (``NO_REPLY``) and creates a new UNSENT instance (``sched/transitioner.cpp``).
* :func:`file_deleter`: removes the input files (not ``<no_delete/>``) and uploaded outputs
  of workunits BOINC considers finished: assimilated, or with an error mask
  (cancelled ones included) (``sched/file_deleter.cpp``).
"""

from __future__ import annotations

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


def send(project: BoincProject, wu_names: list[str], hostid: int = 1, now: float | None = None,
         flops: float = 4e9) -> list[str]:
    """Send one UNSENT result of each named workunit (in the order given), to a host the
    scheduler believes does ``flops`` per second; the results' names."""
    now = int(now if now is not None else time.time())
    sent = []
    for wu in wu_names:
        r = rows(project, "SELECT r.id, r.name, w.delay_bound FROM result r JOIN workunit w ON w.id = r.workunitid "
                          "WHERE w.name = %s AND r.server_state = 2 AND w.error_mask = 0 ORDER BY r.id LIMIT 1", (wu,))
        if not r:
            continue
        _exec(project, "UPDATE result SET server_state = 4, sent_time = %s, report_deadline = %s, hostid = %s, "
                       "flops_estimate = %s WHERE id = %s",
              (now, now + int(r[0]["delay_bound"]), hostid, flops, r[0]["id"]))
        sent.append(r[0]["name"])
    return sent


def report(project: BoincProject, result: str, success: bool = True, now: float | None = None,
           elapsed_s: float = 0.0) -> None:
    """The host reports the result after ``elapsed_s`` of run time (a late report is
    accepted, as BOINC does)."""
    now = int(now if now is not None else time.time())
    _exec(project, "UPDATE result SET server_state = 5, outcome = %s, received_time = %s, validate_state = 0, "
                   "elapsed_time = %s WHERE name = %s", (1 if success else 3, now, elapsed_s, result))


def validate(project: BoincProject, result: str) -> None:
    """The result is valid and canonical; the workunit is ready for the assimilator."""
    r = rows(project, "SELECT id, workunitid FROM result WHERE name = %s", (result,))[0]
    _exec(project, "UPDATE result SET validate_state = 1 WHERE id = %s", (r["id"],))
    _exec(project, "UPDATE workunit SET canonical_resultid = %s, assimilate_state = 1 WHERE id = %s "
                   "AND canonical_resultid = 0", (r["id"], r["workunitid"]))


def assimilated(project: BoincProject, wu: str) -> None:
    _exec(project, "UPDATE workunit SET assimilate_state = 2 WHERE name = %s", (wu,))


def time_out(project: BoincProject, now: float | None = None) -> list[str]:
    """Results past their report deadline become NO_REPLY and each gets a new UNSENT
    instance within max_total_results; the names of the timed-out results."""
    now = int(now if now is not None else time.time())
    late = rows(project, "SELECT r.id, r.name, r.workunitid, w.name AS wu, w.max_total_results FROM result r "
                         "JOIN workunit w ON w.id = r.workunitid WHERE r.server_state = 4 AND r.report_deadline < %s",
                (now,))
    for r in late:
        _exec(project, "UPDATE result SET server_state = 5, outcome = 4 WHERE id = %s", (r["id"],))
        n = rows(project, "SELECT COUNT(*) AS n FROM result WHERE workunitid = %s", (r["workunitid"],))[0]["n"]
        if n < r["max_total_results"]:
            _exec(project, "INSERT INTO result (create_time, workunitid, server_state, name) VALUES (%s, %s, 2, %s)",
                  (now, r["workunitid"], f"{r['wu']}_{n}"))
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
