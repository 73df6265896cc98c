"""Fake ``bin/cancel_jobs``: ``cancel_jobs min-ID max-ID`` or ``cancel_jobs --name wuname``
(tools/cancel_jobs.cpp: exactly two arguments)."""

import sys
import time

import _fakemysql
from _fakelib import PROJECT, database, die, record

record("cancel_jobs")
args = sys.argv[1:]
if len(args) != 2:
    die("Usage: cancel_jobs min-ID max-ID\nor cancel_jobs --name wuname")
with database() as db:
    if args[0] == "--name":
        wu = db["workunits"].get(args[1])
        if wu is None:
            die(f"No workunit named '{args[1]}'")
        wu["error_mask"] |= 16
    else:
        lo, hi = int(args[0]), int(args[1])
        if not lo or not hi:
            die("Usage: cancel_jobs min-ID max-ID")
        for wu in db["workunits"].values():
            if lo <= wu["id"] <= hi:
                wu["error_mask"] |= 16
if _fakemysql.enabled(PROJECT):
    # tools/backend_lib.cpp cancel_job(s): unsent results become OVER/DIDNT_NEED, the
    # workunit gets WU_ERROR_CANCELLED; results in progress stay (the host may report them).
    conn = _fakemysql.connect(PROJECT)
    with conn.cursor() as c:
        if args[0] == "--name":
            c.execute("SELECT id FROM workunit WHERE name=%s", (args[1],))
            ids = [r["id"] for r in c.fetchall()]
        else:
            c.execute("SELECT id FROM workunit WHERE id BETWEEN %s AND %s", (int(args[0]), int(args[1])))
            ids = [r["id"] for r in c.fetchall()]
        for wid in ids:
            c.execute("UPDATE result SET server_state=5, outcome=5 WHERE server_state<=2 AND workunitid=%s", (wid,))
            c.execute("UPDATE workunit SET error_mask=error_mask|16, transition_time=%s WHERE id=%s",
                      (int(time.time()), wid))
    conn.close()
