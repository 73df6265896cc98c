"""``boinc-dl plan``: predicted time and cost of fleets for a job, and the recommended one."""

from __future__ import annotations

import re
import statistics
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from boinc_dl.server.cli.app import console, err_console, error_line, fail
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


def _dataset_size(spec) -> int:
    from boinc_dl.server.common.datasets import load_dataset

    return len(load_dataset(spec.dataset, spec.seed).x_train)  # nosec B615 - boinc-dl's own loader


def calibration_run(spec, spec_file: Path, crowd_slots: int = 0):
    """Run two epochs of the spec's real units on this host (1 worker, 1 slot, 1
    assimilator, the real client app) and calibrate from its units.csv: the run's
    recorded durations calibrate the plan, as a past run's would. With ``crowd_slots``
    > 1, a second short run of 1 worker x that many slots (two units per slot and epoch)
    is pooled with it: it calibrates the contention term (a unit's CPU seconds grow with
    the units running beside it, docs/planner.md)."""
    import io
    from dataclasses import replace

    from rich.console import Console

    from boinc_dl.server.common.procs import owned_prefix, sweep_orphaned_dirs
    from boinc_dl.server.common.spec import parse_spec
    from boinc_dl.server.planner.calibrate import read_calibrations
    from boinc_dl.server.run.job import run_job

    shapes = [(1, None)] + ([(crowd_slots, 2 * crowd_slots)] if crowd_slots > 1 else [])
    # A plan SIGKILLed during its calibration runs could not remove their directory:
    # the next plan does (its owner's process is gone).
    sweep_orphaned_dirs(Path(tempfile.gettempdir()), "bdl-plan-cal.")
    with tempfile.TemporaryDirectory(prefix=owned_prefix("bdl-plan-cal")) as tmp:
        dirs = []
        for slots, units in shapes:
            data = spec.model_dump()
            data["training"]["epochs"] = 2  # the second epoch's close is a steady evaluation
            data["backend"]["kind"] = "local"
            data["backend"]["local"].update(workers=1, slots=slots, assimilators=1, preempt_prob=0.0)
            if units is not None:
                data["vcasgd"]["n_subsets"] = units
            data["name"] = f"{spec.name}-calibration" + (f"-{slots}" if slots > 1 else "")
            cal = parse_spec(data, base_dir=spec_file.parent)
            dirs.append(Path(tmp) / f"run-{slots}")
            # The real run path (private Redis, the local backend, the report files), quiet.
            run_job(cal, dirs[-1], console=Console(file=io.StringIO()), live=False, search_path=spec_file.parent)
        out = read_calibrations(dirs)
    return replace(out, source="the calibration run" + (f"s here (1 slot, {crowd_slots} slots)" if len(dirs) > 1
                                                         else " here"))


def plan(spec_file: Annotated[Path, typer.Argument(help="job spec (YAML)")],
         fleet: Annotated[Path | None, typer.Option(
             "--fleet", help="fleet.yaml: the fleet controller's (its planner: section) or a planner-only one; "
                             "without it, plan the local backend on this machine")] = None,
         deadline: Annotated[str | None, typer.Option(help="finish within, e.g. 8h")] = None,
         budget: Annotated[float | None, typer.Option(help="spend at most, USD")] = None,
         calibrate: Annotated[list[Path] | None, typer.Option(
             "--calibrate", metavar="<path>",
             help="a past run's directory or units.csv to calibrate from; repeat it to pool "
                                 "several runs (default: run one short calibration here when the plan needs a "
                                 "unit time)")] = None,
         project: Annotated[Path | None, typer.Option(
             "--project", help="a BOINC project directory: calibrate from the job's records there (its merge "
                               "records in the project's Redis, or --calibrate's units.csv, and the host-side "
                               "times of BOINC's result table)")] = None,
         job: Annotated[str | None, typer.Option(
             "--job", help="with --project: the job whose records calibrate (default: the spec's name)")] = None,
         history: Annotated[Path | None, typer.Option(hidden=True, help="old name of --calibrate")] = None,
         prices: Annotated[Path | None, typer.Option(help="price table YAML (default: the shipped one)")] = None,
         plot: Annotated[Path | None, typer.Option("--plot", help="write the time-vs-cost plot here")] = None,
         top: Annotated[int, typer.Option(help="rows to print")] = 15) -> None:
    """Predicted epoch time of configurations for a job, and the pick: the local backend on
    this machine (workers x slots, P, unit size), or with --fleet a cloud fleet (types x
    counts x market, T, P, unit size) with dollars and the saving."""
    from dataclasses import replace

    from boinc_dl.server.common.spec import load_spec
    from boinc_dl.server.common.spec_defaults import derive
    from boinc_dl.server.fleet.config import load_planner_fleet
    from boinc_dl.server.planner.calibrate import CalibrationError, read_calibrations
    from boinc_dl.server.planner.fleetfile import FleetFileError
    from boinc_dl.server.planner.local import EXPECTED_ERROR_FLEET, fmt_s, this_machine
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

    if fleet is not None and (deadline is None) == (budget is None):
        raise typer.BadParameter("give exactly one of --deadline and --budget")
    sources = list(calibrate or ([history] if history is not None else []))
    if project is None and len(sources) == 1 and _is_boinc_project(sources[0]):
        project, sources = sources[0], []  # --calibrate PROJECT_DIR: the same as --project PROJECT_DIR
    if job is not None and project is None:
        raise typer.BadParameter("--job names a job of a BOINC project: give --project too")
    try:
        spec = load_spec(spec_file)
        ff = load_planner_fleet(fleet) if fleet is not None else None
        if spec.mode != "vcasgd":
            err_console.print("[red]error:[/] the planner models VC-ASGD jobs (MOP: not yet)")
            raise typer.Exit(2)
        n_train = _dataset_size(spec)
        slots = None if ff is not None else spec.backend.local.workers * spec.backend.local.slots
        spec, _ = derive(spec, n_train, slots)  # n_subsets, local_epochs: never the raw None
        cal = None
        needs_unit = ff is None or any("unit_s" not in row for row in ff.types.values())
        if project is not None:
            cal = boinc_calibration(project, job or spec.name, sources)
        elif not sources and needs_unit:
            # The local plan's contention term: a second run at 2 x cores slots (at most 8,
            # and what the memory holds: each slot is a TensorFlow process).
            here = this_machine()
            crowd = 0 if ff is not None else min(2 * here.cores, here.max_slots(), 8)
            console.print("calibrating: two epochs of the spec's real units on this host (1 slot"
                          + (f", then {crowd} slots" if crowd else "") + "); --calibrate RUN_DIR reuses past runs "
                          "instead")
            cal = calibration_run(spec, spec_file, crowd)
        elif sources:
            cal = read_calibrations(sources)
        if cal is not None:
            console.print(f"calibration: {cal.describe()}")
        if cal is not None and cal.boinc is not None:
            _print_boinc(cal.boinc, fleet=ff is not None)
    except (BoincDLError, FleetFileError, CalibrationError) as e:
        if isinstance(e, BoincDLError):
            fail(e)
        err_console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None
    params = (ff.params if ff is not None else None) or _model_params(spec, spec_file)
    if ff is None:
        assert cal is not None
        _plan_local(spec, cal, params, n_train, top)
        return
    goal = Goal(deadline_s=parse_duration(deadline) if deadline else None, budget=budget)
    examples = n_train / spec.vcasgd.n_subsets * (spec.training.local_epochs or 1)
    unit_s = cal.unit_compute_s(examples) if cal is not None else None
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
        w = Workload(spec.vcasgd.n_subsets, spec.training.epochs, params,
                     base_units_per_epoch=spec.vcasgd.n_subsets)
        costs = ff.server_costs(w.model_bytes(), cal)
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
        t.add_row(mark, describe(planner, s.cand), fmt_s(s.pred.epoch_s), f"{s.hours:.2f} h",
                  f"${s.dollars:,.2f}", f"-{s.saving:.0%}", _bound(planner, s))
    console.print(t)
    if res.best is None:
        console.print(f"[yellow]no candidate meets the goal[/] ({goal.why()}); closest on the front above")
    else:
        b = res.best
        console.print(f"[bold]recommended[/] (*): {describe(planner, b.cand)} — {goal.why()}: "
                      f"epoch {fmt_s(b.pred.epoch_s)}, {b.hours:.2f} h, ${b.dollars:,.2f} "
                      f"({b.pred.method}; bound by {_bound(planner, b)})")
    for r in (g, ga):
        rg = regret(r.best, res.best, goal)
        console.print(f"{r.method}: {describe(planner, r.best.cand) if r.best else 'nothing feasible'}, "
                      f"{r.evaluated} evaluations, regret "
                      f"{'n/a' if rg is None else f'{rg:.1%}'} vs exact ({res.evaluated} candidates)")
    console.print(f"prices: {book.source()}")
    console.print(f"model: closed form for all {len(scored)} candidates; simulation for the best ones; "
                  f"merge {costs.merge_s * 1e3:.1f} ms ({'calibrated' if cal and cal.merge_s is not None else 'estimated from the model size' if 'merge_s' not in ff.costs else 'fleet file'}), "
                  f"staging {costs.stage_s:.3f} s per unit{_stage_from(ff, cal)}, "
                  f"dispatch {costs.dispatch_s:.3f} s per unit{_dispatch_from(ff, cal)} "
                  f"(median unit {statistics.median(h.unit_s for h in hosts):.3f} s)")
    console.print(f"expected error: about ±{EXPECTED_ERROR_FLEET:.0%} of the epoch time (the planner bench's "
                  "MAPE with separate hosts, bench/README.md; a real fleet adds its own spread; for this "
                  "machine alone plan without --fleet)")
    if plot is not None:
        if res.best is not None:
            scored = [*scored, replace(res.best)]
        out = plot_plan(plot, scored, res.best, f"{spec.name}: predicted time vs cost", goal.deadline_s, goal.budget)
        console.print(f"plot: {out}")


def _is_boinc_project(path: Path) -> bool:
    """A BOINC project directory (config.xml) rather than a run directory (units.csv)."""
    return path.is_dir() and (path / "config.xml").is_file() and not (path / "units.csv").is_file()


def boinc_calibration(project_dir: Path, job: str, units: list[Path]):
    """Calibrate from a BOINC job's own records: the per-unit merge records (the job's
    store in the project's Redis, or ``units`` -- run directories or units.csv files
    written from them, pooled) for the client's and the assimilator's durations, and
    BOINC's result table for the host side (elapsed and CPU time, sent and received
    times, per host).

    Exit status 3 when BOINC's database cannot be reached (as for Redis: try again); a
    project, job or table without what is needed is a clear error (exit status 2)."""
    from dataclasses import replace

    from boinc_dl.server.backends.boinc.boincdb import BoincDB, BoincDBError, credentials
    from boinc_dl.server.backends.boinc.project import BoincProject
    from boinc_dl.server.planner.boinc_times import boinc_times
    from boinc_dl.server.planner.calibrate import (
        CalibrationError,
        calibration_from_rows,
        epoch_evals,
        read_calibrations,
        read_unit_rows,
    )

    proj = BoincProject(project_dir).require()
    if units:
        cal = read_calibrations(units)
        rows: list = [r for u in units for r in read_unit_rows(u)]
    else:
        from boinc_dl.server.assimilator.connection import connect
        from boinc_dl.server.assimilator.store import JobStore
        from boinc_dl.server.run.outputs import collect_history

        # The one home of a job's per-unit rows: what a run writes to units.csv, read
        # here from the store the project's assimilators write to (never its URL in the
        # output: it may carry a password).
        hist = collect_history(JobStore(connect(proj.redis_url()), job).require())
        rows = hist["units"]
        cal = calibration_from_rows(rows, f"job {job}'s merge records in the project's Redis",
                                    *epoch_evals(hist["epochs"]))
    args = credentials(proj)  # a config.xml without <db_name>: exit 2, like any bad input
    db_where = f"BOINC's result table ({args['database']} at {args.get('unix_socket') or args['host']})"
    try:
        with BoincDB.connect(proj) as db:
            results = db.job_result_timings(f"{job}__")
    except BoincDBError as e:
        error_line(str(e))  # pymysql's messages carry brackets: no console markup
        raise typer.Exit(3) from None
    try:
        times = boinc_times(results, rows, job, f"job {job}'s workunits in {db_where}")
    except ValueError as e:
        raise CalibrationError(str(e)) from None
    return replace(cal, boinc=times)


def _print_boinc(times, fleet: bool) -> None:
    """What BOINC's result table said, per host too, and where the plan uses it."""
    from boinc_dl.server.planner.boinc_times import HOSTS_SHOWN

    console.print(f"BOINC: {times.describe()}")
    console.print(f"BOINC hosts: {times.spread()}")
    t = Table(title="BOINC's results per host (medians)")
    for col in ("host", "results", "elapsed", "host-side overhead", "network and queue"):
        t.add_column(col)
    for h in times.hosts[:HOSTS_SHOWN]:
        t.add_row(str(h.hostid), str(h.results), f"{h.elapsed_s:.3f} s",
                  "-" if h.overhead_s is None else f"{h.overhead_s:.3f} s", f"{h.network_queue_s:.3f} s")
    if len(times.hosts) > HOSTS_SHOWN:
        t.add_row(f"... {len(times.hosts) - HOSTS_SHOWN} more", "", "", "", "")
    console.print(t)
    if not fleet:
        console.print("BOINC's host-side times go into a fleet plan (--fleet): the local backend planned "
                      "here runs no wrapper and moves nothing over a network")


def _stage_from(ff, cal) -> str:
    """Where the staging per unit came from, for the model line."""
    if "stage_s" in ff.costs:
        return " (fleet file)"
    if cal is None:
        return " (estimated from the model size)"
    if cal.boinc is not None and cal.boinc.overhead_s is not None:
        return (f" (the app's own {cal.overhead_s:.3f} s outside training + BOINC's host-side "
                f"{cal.boinc.overhead_s:.3f} s)")
    return " (the app's own time outside training, calibrated)"


def _dispatch_from(ff, cal) -> str:
    if "dispatch_s" in ff.costs:
        return " (fleet file)"
    if cal is not None and cal.boinc is not None:
        return " (BOINC's network and queue time: received - sent - elapsed)"
    return " (default)"


def _bound(planner, s) -> str:
    """clients, servers, or network (clients whose unit time is mostly transfer)."""
    from boinc_dl.server.planner.local import transfer_share

    if s.pred.bound == "clients" and transfer_share(planner.config(s.cand), planner.workload, planner.costs) > 0.5:
        return "network"
    return s.pred.bound


def _plan_local(spec, cal, params: int, n_train: int, top: int) -> None:
    """The local backend on this machine: every workers x slots x P x unit size, simulated."""
    from dataclasses import replace

    from boinc_dl.server.planner.local import (
        EXPECTED_ERROR_LOCAL,
        background_load,
        fmt_s,
        plan_local,
        this_machine,
    )

    machine = replace(this_machine(), background=round(background_load(), 2))
    mem = f"{machine.memory_bytes / 2**30:.1f} GiB" if machine.memory_bytes else "unknown memory"
    plans = plan_local(cal, machine, epochs=spec.training.epochs, params=params, n_train=n_train,
                       local_epochs=spec.training.local_epochs or 1, units_per_epoch=spec.vcasgd.n_subsets,
                       window=spec.vcasgd.window, timeout_s=spec.units.timeout_s)
    loc = spec.backend.local
    mine = next((p for p in plans if (p.cand.workers, p.cand.slots, p.cand.assimilators, p.cand.units_per_epoch)
                 == (loc.workers, loc.slots, loc.assimilators, spec.vcasgd.n_subsets)), None)
    t = Table(title=f"boinc-dl plan · {spec.name} · local backend on this machine ({machine.cores} cores, {mem}, "
                    f"{machine.background:.1f} busy with other work) · "
                    f"{spec.training.epochs} epochs, {params:,} parameters")
    for col in ("", "configuration", "epoch", "total", "bound"):
        t.add_column(col)
    shown = plans[:top] + ([mine] if mine is not None and mine not in plans[:top] else [])
    for p in shown:
        mark = "*" if p is plans[0] else "spec" if p is mine else ""
        t.add_row(mark, p.cand.describe(), fmt_s(p.pred.epoch_s), fmt_s(p.pred.job_s), p.bound)
    console.print(t)
    b = plans[0]
    console.print(f"[bold]recommended[/] (*): {b.cand.describe()} — the fastest: epoch {fmt_s(b.pred.epoch_s)}, "
                  f"{fmt_s(b.pred.job_s)} for {spec.training.epochs} epochs (bound by {b.bound})")
    if mine is not None:
        console.print(f"the spec's own ({mine.cand.describe()}): epoch {fmt_s(mine.pred.epoch_s)} "
                      f"(bound by {mine.bound})")
    console.print(f"expected error: about ±{EXPECTED_ERROR_LOCAL:.0%} of the pipeline's epoch time on a machine "
                  "at rest (the planner bench's MAPE on generated configurations it was not calibrated on, "
                  "bench/README.md); other work that starts or stops during the run moves it most (13-26% "
                  "measured so), then the calibration runs' own CPU seconds (2-30% apart from one run to the "
                  "next); start-up (slots loading TensorFlow) is not in it")
    if cal.contention.units == 0 and max(p.cand.workers * p.cand.slots for p in plans) > 1:
        console.print("contention not calibrated (g = 0): plans of many slots may be optimistic (measured 10-40% "
                      "at 6 slots on 2 cores); add --calibrate with a run of 2 x cores slots (docs/planner.md)")
