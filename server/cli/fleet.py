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
from rich.console import Console
from rich.table import Table

from boinc_dl.server.cli.app import redis_url_for
from boinc_dl.server.common.errors import BoincDLError

fleet_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="Spot/preemptible cloud fleets: size, replace, re-issue early, fall back.")
console = Console()
err = Console(stderr=True)

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="fleet.yaml")]


def _fail(e: BaseException) -> None:
    err.print(f"[red]error:[/] {e}", markup=True, highlight=False)
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
    """The controller's last period as it published it in Redis."""
    from boinc_dl.server.assimilator.connection import connect
    from boinc_dl.server.backends.boinc.project import BoincProject
    from boinc_dl.server.fleet.config import load_config
    from boinc_dl.server.fleet.controller import STATUS_KEY

    try:
        cfg = load_config(config)
        r = connect(BoincProject(cfg.project).require().redis_url())
        raw = {k.decode(): v.decode() for k, v in r.hgetall(STATUS_KEY).items()}
    except BoincDLError as e:
        _fail(e)
        return
    if not raw:
        _fail(BoincDLError("no fleet status yet: is 'boinc-dl fleet watch' running?"))
    import time

    t = Table(show_header=False, title=f"fleet ({raw.get('provider', '?')})")
    age = time.time() - float(raw.get("time", 0))
    t.add_row("last period", f"{age:.0f} s ago")
    t.add_row("hosts", f"{raw.get('running')} running, {raw.get('desired')} desired")
    t.add_row("on-demand share", f"{raw.get('on_demand_percent')}%")
    t.add_row("fallback", raw.get("fallback") or "no (spot is calm)")
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
