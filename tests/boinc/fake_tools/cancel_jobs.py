"""Fake ``bin/cancel_jobs``: ``cancel_jobs min-ID max-ID`` or ``cancel_jobs --name wuname``
(tools/cancel_jobs.cpp: exactly two arguments)."""

import sys

from _fakelib import database, die, record

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
