"""``boinc-dl redis ...``: check that a Redis keeps boinc-dl's durability promise, and flush
its append-only file to disk once a second (what ``appendfsync no`` leaves to the admin)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from boinc_dl.server.cli.app import console, fail, redis_url_for
from boinc_dl.server.common.errors import BoincDLError

redis_app = typer.Typer(no_args_is_help=True, help="Check and look after the Redis that holds the job state.")


@redis_app.command()
def check(
    redis_url: Annotated[str | None, typer.Option(envvar="BDL_REDIS_URL", help="the Redis (or cluster) to check")] = None,
    project: Annotated[Path | None, typer.Option(help="BOINC project: check the Redis in its boinc-dl.yaml")] = None,
) -> None:
    """Read the persistence settings of every master and say what would lose merges.

    Exits 1 when a setting can lose acknowledged merges in a crash, 0 otherwise."""
    from boinc_dl.server.assimilator.connection import connect
    from boinc_dl.server.assimilator.persistence import (
        RECOMMENDED,
        SETTINGS,
        findings,
        read_settings,
    )

    try:
        r = connect(redis_url_for(redis_url, project))
        settings = read_settings(r)
    except BoincDLError as e:
        fail(e)
        return
    # One column per node: settings down, nodes across (a cluster has several masters).
    table = Table("setting", *settings, "boinc-dl's own Redis")
    for key in SETTINGS:
        table.add_row(key, *("?" if isinstance(s, str) else s.get(key, "") for s in settings.values()),
                      RECOMMENDED.get(key, ""))
    console.print(table)
    found = findings(settings)
    colour = {"error": "red", "warning": "yellow", "note": "cyan"}
    for f in found:
        console.print(f"[{colour[f.severity]}]{f.severity}[/]: {f.node}: {f.message}", highlight=False)
    if not found:
        console.print("[green]ok[/]: every node appends before it replies and fsyncs every write")
    if any(f.severity == "error" for f in found):
        raise typer.Exit(1)


@redis_app.command("sync-aof")
def sync_aof(
    data_dir: Annotated[Path, typer.Argument(help="Redis's data dir (its `dir` setting; holds appendonlydir/)")],
    interval: Annotated[float, typer.Option(min=0.05, help="seconds between two fdatasync passes")] = 1.0,
) -> None:
    """fdatasync Redis's append-only file every INTERVAL seconds until SIGTERM or Ctrl-C.

    Run it beside a Redis with ``appendfsync no`` (as a service of its own, with read
    access to the data dir): an OS crash then loses at most about INTERVAL seconds of
    merges, and a crash of Redis itself none."""
    from boinc_dl.server.assimilator.aof_sync import AofSyncer, aof_files

    if not data_dir.is_dir():
        fail(BoincDLError(f"{data_dir} is not a directory (give Redis's `dir`)"))
        return
    syncer = AofSyncer(data_dir, interval)
    n = len(aof_files(data_dir))
    console.print(f"syncing the AOF in {data_dir} every {interval:g} s ({n} file(s) now); "
                  "stop with SIGTERM or Ctrl-C", highlight=False)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    syncer.start()
    while not done.wait(1.0):
        if not syncer.running:  # the thread died: say so rather than pretend to sync
            fail(BoincDLError(f"the sync thread for {data_dir} stopped"))
            return
    syncer.stop()  # a last pass: nothing written before the signal is left unsynced
    console.print(f"stopped after {syncer.passes} pass(es)", highlight=False)
