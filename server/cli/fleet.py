"""``boinc-dl fleet watch|status`` and ``boinc-dl cost JOB`` (mounted by the main CLI).

``fleet watch`` is a daemon like the project's others: it stops on SIGHUP/SIGTERM and
when the project's ``stop_daemons`` file appears, so it can be declared in
``config.xml`` (see ``docs/fleet.md``).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from boinc_dl.server.cli.app import console, error_line, redis_url_for
from boinc_dl.server.common.errors import BoincDLError

fleet_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="Spot/preemptible cloud fleets: size, replace, re-issue early, fall back.")

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="fleet.yaml")]


def _fail(e: BaseException) -> None:
    """``e`` as one ``error:`` line (whatever the terminal's width), then its exit code."""
    error_line(str(e))
    raise typer.Exit(getattr(e, "exit_code", 2))


@fleet_app.command()
def watch(
    config: ConfigOpt,
    periods: Annotated[int | None, typer.Option(help="stop after this many control periods")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """The fleet controller daemon (one control period every period_s)."""
    from boinc_dl.server.fleet.config import load_config
    from boinc_dl.server.fleet.factory import build_controller

    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s [%(levelname)s] %(name)s: %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    try:
        cfg = load_config(config)
        ctl = build_controller(cfg)
    except BoincDLError as e:
        _fail(e)
        return
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        logging.getLogger("boinc-dl.fleet").info("got %s: stopping", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    stop_file = Path(cfg.project) / "stop_daemons"

    def watch_stop_file() -> None:
        while not stop.wait(1.0):
            if stop_file.exists():
                logging.getLogger("boinc-dl.fleet").info("quitting: trigger file %s is present", stop_file)
                stop.set()

    threading.Thread(target=watch_stop_file, daemon=True).start()
    raise typer.Exit(ctl.run(stop, max_periods=periods))


@fleet_app.command()
def status(config: ConfigOpt) -> None:
    """The controller's last period and its durable fallback state, from Redis."""
    import time

    from boinc_dl.server.assimilator.connection import connect
    from boinc_dl.server.backends.boinc.project import BoincProject
    from boinc_dl.server.fleet.config import load_config
    from boinc_dl.server.fleet.state import FleetState

    try:
        cfg = load_config(config)
        st = FleetState(connect(BoincProject(cfg.project).require().redis_url()), cfg.fleet_name())
        raw, fb, holder = st.status(), st.fallback(), st.holder()
    except BoincDLError as e:
        _fail(e)
        return
    if not raw.get("time"):
        _fail(BoincDLError(f"no status of fleet {st.fleet} yet: is 'boinc-dl fleet watch' running?"))
    now = time.time()
    t = Table(show_header=False, title=f"fleet {st.fleet} ({raw.get('provider', '?')})")
    t.add_row("last period", f"{now - float(raw['time']):.0f} s ago")
    t.add_row("controller", f"{holder[0]} (lease {holder[1]:.0f} s more)" if holder else "none holds the lease")
    draining = int(raw.get("draining") or 0)
    t.add_row("hosts", f"{raw.get('running')} running" + (f" (+{draining} draining)" if draining else "")
              + f", {raw.get('desired')} desired")
    t.add_row("on-demand share", f"{raw.get('on_demand_percent')}%")
    if fb.active:
        t.add_row("fallback", f"since {now - fb.since:.0f} s: {fb.reason}; last trouble "
                  f"{now - fb.last_trouble:.0f} s ago (hold {cfg.fallback.hold_s:.0f} s)")
    else:
        t.add_row("fallback", "no (spot is calm)")
    t.add_row("reclaims in window", f"{raw.get('reclaims_in_window', 0)} in {cfg.fallback.window_s:.0f} s")
    t.add_row("re-issued early", f"{raw.get('reissued_total', 0)} units in all")
    t.add_row("decision time", f"{raw.get('decision_ms')} ms")
    if raw.get("last_reasons"):
        t.add_row("last decisions", raw["last_reasons"])
    console.print(t)


def cost(
    job: Annotated[str, typer.Argument(help="job name")],
    redis_url: Annotated[str | None, typer.Option(help="Redis holding the job state (env BDL_REDIS_URL)")] = None,
    project: Annotated[Path | None, typer.Option(help="BOINC project whose Redis holds the job")] = None,
) -> None:
    """What a job's fleet time cost: by instance type and market, lost to reclaims, saved."""
    from boinc_dl.server.assimilator.connection import connect
    from boinc_dl.server.assimilator.store import JobStore
    from boinc_dl.server.common.errors import UnknownJob
    from boinc_dl.server.fleet.cost import cost_report

    try:
        r = connect(redis_url_for(redis_url, project))
        if not JobStore(r, job).exists():
            raise UnknownJob(f"no job named {job!r}")
        rep = cost_report(r, job)
    except BoincDLError as e:
        _fail(e)
        return
    t = Table(title=f"{job}: cloud cost")
    for col in ("instance type", "market", "hours", "cost $"):
        t.add_column(col, justify="left" if col in ("instance type", "market") else "right")
    for ln in rep["lines"]:
        t.add_row(ln["type"], ln["market"], f"{ln['hours']:.3f}", f"{ln['usd']:.2f}")
    t.add_row("total", "", f"{rep['instance_hours']}", f"{rep['total_usd']}")
    console.print(t)
    console.print(f"on-demand equivalent ${rep['on_demand_usd']}: saved ${rep['saving_usd']} "
                  f"({rep['saving_pct']}%)")
    console.print(f"lost to {rep['reclaims']} reclaim(s): {rep['lost_hours']} instance-hours, ${rep['lost_usd']}")
    if rep["waived_n"] or rep["drain_saved_usd"]:
        console.print(f"draining instead of terminating: the cloud waived {rep['waived_n']} first-hour "
                      f"bill(s) (${rep['waived_usd']}); saved ${rep['drain_saved_usd']} against terminating "
                      "on the warning")
    if rep["provisional_hours"]:
        console.print(f"provisional: {rep['provisional_hours']} instance-hours, ${rep['provisional_usd']} "
                      "(spot instances in their first hour: waived if the cloud reclaims them)")
