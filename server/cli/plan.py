"""``boinc-dl plan``: predicted time and cost of fleets for a job, and the recommended one."""

from __future__ import annotations

import re
import statistics
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from boinc_dl.server.cli.app import console, err_console, fail
from boinc_dl.server.common.errors import BoincDLError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")


def parse_duration(text: str) -> float:
    """``8h``, ``90m``, ``3600`` (seconds), ``1.5d`` -> seconds."""
    m = _DURATION.match(text)
    if not m:
        raise typer.BadParameter(f"not a duration: {text!r} (e.g. 8h, 90m, 3600)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def _model_params(spec, spec_file: Path) -> int:
    from boinc_dl.server.common.keras_model import build_model

    model = build_model(spec.model, spec.model_args, search_path=spec_file.parent)
    return int(model.count_params())


def calibrate_on_host(spec, spec_file: Path) -> tuple[float, float | None]:
    """Run the spec's units for one epoch on this host (1 slot, 1 assimilator, the real
    client app) and return (median unit wall time, median merge gap)."""
    import io

    from rich.console import Console

    from boinc_dl.server.common.spec import parse_spec
    from boinc_dl.server.planner.calibrate import read_history
    from boinc_dl.server.run.job import run_job

    data = spec.model_dump()
    data["training"]["epochs"] = 1
    data["backend"]["local"].update(workers=1, slots=1, assimilators=1, preempt_prob=0.0)
    data["name"] = f"{spec.name}-calibration"
    cal = parse_spec(data, base_dir=spec_file.parent)
    with tempfile.TemporaryDirectory(prefix="bdl-plan-cal-") as tmp:
        # The real run path (private Redis, the local backend, the report files), quiet.
        run_job(cal, Path(tmp) / "run", console=Console(file=io.StringIO()), live=False,
                search_path=spec_file.parent)
        h = read_history(Path(tmp) / "run" / "units.csv")
    if h.wall_s is None:
        raise BoincDLError("calibration: no unit was merged")
    return h.wall_s, h.merge_gap_s


def plan(spec_file: Annotated[Path, typer.Argument(help="job spec (YAML)")],
         fleet: Annotated[Path, typer.Option("--fleet", help="fleet.yaml: the fleet controller's (its planner: "
                                                             "section) or a planner-only one")],
         deadline: Annotated[str | None, typer.Option(help="finish within, e.g. 8h")] = None,
         budget: Annotated[float | None, typer.Option(help="spend at most, USD")] = None,
         calibrate: Annotated[bool, typer.Option("--calibrate", help="time real units of the spec here")] = False,
         history: Annotated[Path | None, typer.Option(help="a run's units.csv to calibrate from")] = None,
         prices: Annotated[Path | None, typer.Option(help="price table YAML (default: the shipped one)")] = None,
         plot: Annotated[Path | None, typer.Option("--plot", help="write the time-vs-cost plot here")] = None,
         top: Annotated[int, typer.Option(help="rows to print")] = 15) -> None:
    """Candidates (types x counts x market, T, P, unit size): time, dollars, saving; the pick."""
    from dataclasses import replace

    from boinc_dl.server.common.spec import load_spec
    from boinc_dl.server.fleet.config import load_planner_fleet
    from boinc_dl.server.planner.calibrate import read_history
    from boinc_dl.server.planner.fleetfile import FleetFileError
    from boinc_dl.server.planner.model import Workload
    from boinc_dl.server.planner.plot import plot_plan
    from boinc_dl.server.planner.prices import DEFAULT_TABLE, PriceError, TablePriceBook
    from boinc_dl.server.planner.search import (
        Goal,
        Planner,
        Space,
        describe,
        exact,
        genetic,
        greedy,
        pareto,
        regret,
    )

    if (deadline is None) == (budget is None):
        raise typer.BadParameter("give exactly one of --deadline and --budget")
    goal = Goal(deadline_s=parse_duration(deadline) if deadline else None, budget=budget)
    try:
        spec = load_spec(spec_file)
        ff = load_planner_fleet(fleet)
    except (BoincDLError, FleetFileError) as e:
        if isinstance(e, BoincDLError):
            fail(e)
        err_console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None
    if spec.mode != "vcasgd":
        err_console.print("[red]error:[/] the planner models VC-ASGD jobs (MOP: not yet)")
        raise typer.Exit(2)
    unit_s = merge_gap = None
    if history is not None:
        h = read_history(history)
        unit_s, merge_gap = h.wall_s, h.merge_gap_s
        console.print(f"history: {h.units} merged units, unit wall {unit_s} s, merge gap {merge_gap} s")
    if calibrate:
        unit_s, merge_gap = calibrate_on_host(spec, spec_file)
        console.print(f"calibrated on this host: unit {unit_s:.3f} s, merge gap {merge_gap} s")
    book = TablePriceBook.load(prices or DEFAULT_TABLE)
    if ff.on_demand_prices or ff.spot_prices:
        try:
            book = book.with_prices(ff.on_demand_prices, ff.spot_prices)
        except PriceError as e:
            err_console.print(f"[red]error:[/] {e}")
            raise typer.Exit(2) from None
    if ff.spot_history:
        book = book.with_spot_history(ff.spot_history, now=max(float(p.time) for p in ff.spot_history))
    try:
        hosts, counts = ff.host_types(unit_s)
        params = ff.params or _model_params(spec, spec_file)
        w = Workload(spec.vcasgd.n_subsets, spec.training.epochs, params,
                     base_units_per_epoch=spec.vcasgd.n_subsets)
        costs = ff.server_costs(w.model_bytes(), merge_gap)
        space = Space(tuple(hosts), tuple(counts), tuple(ff.markets), ff.slots, ff.assimilators,
                      ff.units_per_epoch or (spec.vcasgd.n_subsets,), ff.server_type, spec.units.timeout_s)
        planner = Planner(space, w, costs, book)
        res, scored = exact(planner, goal)
    except (FleetFileError, PriceError) as e:
        err_console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None
    g, ga = greedy(planner, goal), genetic(planner, goal)
    t = Table(title=f"boinc-dl plan · {spec.name} · {spec.training.epochs} epochs, {params:,} parameters")
    for col in ("", "configuration", "epoch", "total", "USD", "vs on-demand", "bound"):
        t.add_column(col)
    front = pareto(scored)
    feasible = sorted((s for s in scored if goal.feasible(s)), key=goal.objective)[:max(0, top - len(front))]
    rows = {x.cand: x for x in [*front, *feasible]}
    if res.best is not None:
        rows[res.best.cand] = res.best
    for s in sorted(rows.values(), key=lambda s: s.pred.job_s)[:top]:
        mark = "*" if res.best is not None and s.cand == res.best.cand else ""
        t.add_row(mark, describe(planner, s.cand), f"{s.pred.epoch_s:,.0f} s", f"{s.hours:.2f} h",
                  f"${s.dollars:,.2f}", f"-{s.saving:.0%}", s.pred.bound)
    console.print(t)
    if res.best is None:
        console.print(f"[yellow]no candidate meets the goal[/] ({goal.why()}); closest on the front above")
    else:
        b = res.best
        console.print(f"[bold]recommended[/] (*): {describe(planner, b.cand)} — {goal.why()}: "
                      f"{b.hours:.2f} h, ${b.dollars:,.2f} ({b.pred.method}; bound by {b.pred.bound})")
    for r in (g, ga):
        rg = regret(r.best, res.best, goal)
        console.print(f"{r.method}: {describe(planner, r.best.cand) if r.best else 'nothing feasible'}, "
                      f"{r.evaluated} evaluations, regret "
                      f"{'n/a' if rg is None else f'{rg:.1%}'} vs exact ({res.evaluated} candidates)")
    console.print(f"prices: {book.source()}")
    console.print(f"model: closed form for all {len(scored)} candidates; simulation for the best ones; "
                  f"merge {costs.merge_s:.3f} s, staging {costs.stage_s:.3f} s per unit "
                  f"(median unit {statistics.median(h.unit_s for h in hosts):.2f} s)")
    if plot is not None:
        if res.best is not None:
            scored = [*scored, replace(res.best)]
        out = plot_plan(plot, scored, res.best, f"{spec.name}: predicted time vs cost", goal.deadline_s, goal.budget)
        console.print(f"plot: {out}")
