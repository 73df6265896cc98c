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
        script_access,
    )

    try:
        r = connect(redis_url_for(redis_url, project))
        settings = read_settings(r)
        scripts = script_access(r)
    except BoincDLError as e:
        fail(e)
        return
    # One column per node: settings down, nodes across (a cluster has several masters).
    table = Table("setting", *settings, "boinc-dl's own Redis")
    for key in SETTINGS:
        table.add_row(key, *("?" if isinstance(s, str) else s.get(key, "") for s in settings.values()),
                      RECOMMENDED.get(key, ""))
    console.print(table)
    found = findings(settings, scripts)
    colour = {"error": "red", "warning": "yellow", "note": "cyan"}
    for f in found:
        console.print(f"[{colour[f.severity]}]{f.severity}[/]: {f.node}: {f.message}", highlight=False)
    if not found:
        console.print("[green]ok[/]: every node appends before it replies and fsyncs every write")
    _merge_logs(r)
    if any(f.severity == "error" for f in found):
        raise typer.Exit(1)


def _merge_logs(r: object) -> None:
    """Each job's merge log: what a crash of Redis would replay, and what it costs."""
    from boinc_dl.server.assimilator.recovery import REPLAY_S_PER_GB
    from boinc_dl.server.assimilator.snapshot import status
    from boinc_dl.server.assimilator.store import JobStore

    rows = [st for job in JobStore.list_jobs(r) for st in status(JobStore(r, job))]  # type: ignore[arg-type]
    if not rows:
        return
    table = Table("job", "model", "merges in the log", "retained inputs", "last snapshot", "shards to rebuild",
                  "rebuild after a Redis crash")
    for st in rows:
        age = "none yet" if st.snapshot_age_s is None else f"{st.snapshot_age_s / 60:.0f} min ago"
        table.add_row(st.job, st.model, str(st.merges), f"{st.input_bytes / 1e9:.2f} GB", age, str(st.not_live),
                      f"about {st.input_bytes / 1e9 * REPLAY_S_PER_GB:.0f} s")
    console.print(table)
    console.print(
        "merges are logged, not their bytes (docs/fault-tolerance.md): a crash of Redis costs the rebuild "
        "above (newest snapshot + the log's retained inputs, replayed at the first read or merge); a crash "
        "of the machine costs what the AOF had not synced (appendfsync no + sync-aof: about 1 s of merges, "
        "then re-issued; always: none); a lost durable dir (retained inputs, snapshots) costs nothing while "
        "Redis runs, but Redis must not restart before a snapshot is taken again "
        "(`boinc-dl redis snapshot`)", highlight=False)


@redis_app.command()
def snapshot(
    redis_url: Annotated[str | None, typer.Option(envvar="BDL_REDIS_URL", help="the Redis (or cluster)")] = None,
    project: Annotated[Path | None, typer.Option(help="BOINC project: the Redis in its boinc-dl.yaml")] = None,
    job: Annotated[str | None, typer.Option(help="only this job (default: every job with a merge log)")] = None,
) -> None:
    """Snapshot the weights of every model now and truncate the merge log behind it.

    The same snapshot the assimilators take in the background; run it after losing or
    moving the durable dir (retained inputs), so a restart of Redis does not need them."""
    from boinc_dl.server.assimilator.connection import connect
    from boinc_dl.server.assimilator.snapshot import take
    from boinc_dl.server.assimilator.store import JobStore

    try:
        r = connect(redis_url_for(redis_url, project))
        jobs = [job] if job else JobStore.list_jobs(r)
        for name in jobs:
            store = JobStore(r, name).require()
            if store.durable_dir() is None:
                console.print(f"{name}: no durable dir (its merges log their bytes): nothing to do", highlight=False)
                continue
            for model in store.models():
                m = take(store, model)
                if m is None:
                    console.print(f"{name}/{model}: another process is taking a snapshot", highlight=False)
                else:
                    console.print(f"{name}/{model}: snapshot at shard versions {min(m.versions)}..{max(m.versions)}"
                                  f" ({m.file})", highlight=False)
    except BoincDLError as e:
        fail(e)


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
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before the line that says it runs: a SIGTERM
        signal.signal(sig, lambda *_: done.set())  # from then on always gets its last pass
    console.print(f"syncing the AOF in {data_dir} every {interval:g} s ({n} file(s) now); "
                  "stop with SIGTERM or Ctrl-C", highlight=False)
    syncer.start()
    while not done.wait(1.0):
        if not syncer.running:  # the thread died: say so rather than pretend to sync
            fail(BoincDLError(f"the sync thread for {data_dir} stopped"))
            return
    syncer.stop()  # a last pass: nothing written before the signal is left unsynced
    console.print(f"stopped after {syncer.passes} pass(es)", highlight=False)
