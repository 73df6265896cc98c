"""``boinc-dl run / submit / status / cancel / validate``: the job commands.

Every expected failure (bad spec, missing data, Redis unreachable, unknown job)
prints one line and exits non-zero; tracebacks are for bugs only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from boinc_dl.server.cli.app import app, console, error_line, redis_url_for
from boinc_dl.server.cli.app import fail as _fail
from boinc_dl.server.common.errors import BoincDLError, UnknownJob

if TYPE_CHECKING:
    from boinc_dl.server.common.spec import JobSpec


@app.command()
def run(
    spec_file: Annotated[Path, typer.Argument(help="job spec (YAML)")],
    resume: Annotated[bool, typer.Option("--resume", help="continue the job from its saved state")] = False,
    new: Annotated[bool, typer.Option("--new", help="a fresh run beside an earlier one (runs/<job>-2, ...)")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="delete the earlier run of this job and start over")] = False,
    run_dir: Annotated[Path | None, typer.Option(help="run directory (default runs/<job name>)")] = None,
    redis_url: Annotated[str | None, typer.Option(help="use this Redis instead of a private one")] = None,
    workers: Annotated[int | None, typer.Option(help="simulated hosts (overrides the spec)")] = None,
    slots: Annotated[int | None, typer.Option(help="slots per host (overrides the spec)")] = None,
    assimilators: Annotated[int | None, typer.Option(help="assimilator processes")] = None,
    preempt_prob: Annotated[float | None, typer.Option(help="chance a unit is killed mid-way")] = None,
    epochs: Annotated[int | None, typer.Option(help="override training.epochs")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress view or progress lines")] = False,
) -> None:
    """Run a job on the embedded local backend (private Redis, N hosts x T slots).

    A terminal shows a live view; other output (a file, a pipe) gets a line per epoch."""
    from boinc_dl.server.common.spec import load_spec
    from boinc_dl.server.common.spec_checks import check_resources
    from boinc_dl.server.common.tf_env import require_tensorflow
    from boinc_dl.server.run import run_job, summary_table
    from boinc_dl.server.run.signals import stop_on_signals

    chosen = [name for name, on in (("--resume", resume), ("--new", new), ("--overwrite", overwrite)) if on]
    if len(chosen) > 1:
        error_line(f"{' and '.join(chosen)} do not go together: choose one")
        raise typer.Exit(2)
    on_existing = "resume" if resume else "new" if new else "overwrite" if overwrite else "refuse"
    try:
        spec = load_spec(spec_file)
        if epochs is not None:
            spec = spec.model_copy(update={"training": spec.training.model_copy(update={"epochs": epochs})})
        opts = {k: v for k, v in {"workers": workers, "slots": slots, "assimilators": assimilators,
                                  "preempt_prob": preempt_prob}.items() if v is not None}
        check_resources(spec, opts)
        require_tensorflow()
        with stop_on_signals():  # SIGTERM and SIGHUP stop the run as Ctrl-C does
            res = run_job(spec, run_dir, resume=resume, redis_url=redis_url, console=console,
                          live=not quiet and console.is_terminal, backend_opts=opts,
                          search_path=spec_file.resolve().parent, on_existing=on_existing,  # type: ignore[arg-type]
                          lines=not quiet and not console.is_terminal)
    except BoincDLError as e:
        _fail(e)
        return
    console.print(summary_table(res, spec))
    if res.status == "interrupted":
        raise typer.Exit(res.exit_code or 130)
    if res.status != "done":
        error_line(f"job {res.job or spec.name} {res.status}" + (f": {res.reason}" if res.reason else ""))
        raise typer.Exit(1)


@app.command()
def submit(
    spec_file: Annotated[Path, typer.Argument(help="job spec (YAML)")],
    backend: Annotated[str, typer.Option(help="job system: boinc (a BOINC project's daemons run it)")] = "boinc",
    project: Annotated[Path | None, typer.Option(help="BOINC project directory")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="continue a job already recorded")] = False,
) -> None:
    """Submit a job to a BOINC project; its work generator daemon creates the workunits."""
    from boinc_dl.server.common.spec import load_spec

    try:
        if backend == "local":
            raise BoincDLError("the local backend runs in the foreground: use 'boinc-dl run SPEC'")
        if backend != "boinc":
            raise BoincDLError(f"unknown backend {backend!r}; choose boinc (or 'boinc-dl run' for local)")
        if project is None:
            raise BoincDLError("--project is required with --backend boinc")
        from boinc_dl.server.backends.boinc.submit import submit_job

        spec = load_spec(spec_file)
        job_dir = submit_job(spec, project, resume=resume, search_path=spec_file.resolve().parent)
    except BoincDLError as e:
        _fail(e)
        return
    console.print(f"job [cyan]{spec.name}[/] submitted to {project} (files in {job_dir}); "
                  f"follow it with: boinc-dl status {spec.name} --project {project}")


@contextlib.contextmanager
def _open_store_redis(run_dir: Path | None, redis_url: str | None) -> Iterator[Any]:
    """A Redis client: the given URL, a live run's socket, or the run's saved state."""
    from boinc_dl.server.assimilator.connection import connect
    from boinc_dl.server.assimilator.redis_server import EmbeddedRedis

    if redis_url:
        yield connect(redis_url)
        return
    if run_dir is None or not (run_dir / "redis").is_dir():
        raise BoincDLError(f"no job state found in {run_dir}; give --run-dir or --redis-url")
    server = EmbeddedRedis(run_dir / "redis")
    try:
        yield connect(server.url, timeout=1.0)  # the run is live: read its Redis
        return
    except BoincDLError:
        pass
    server.start()  # the run is over: load its append-only file read-only-ish, then stop
    try:
        yield connect(server.url)
    finally:
        server.stop()


def _names_a_run_dir(job: str) -> bool:
    """True when ``boinc-dl status``'s job argument is a run directory rather than a job
    name: a path to a directory with a job state that is not ``runs/<job>`` itself (a job
    name is one path component of letters, digits and ``_.-``)."""
    from boinc_dl.server.common.paths import is_safe_name

    if not (Path(job) / "redis").is_dir():
        return False
    return not is_safe_name(job) or not (Path("runs") / job / "redis").is_dir()


@app.command()
def status(
    job: Annotated[str | None, typer.Argument(help="job name, or a run directory (default: all jobs found)")] = None,
    run_dir: Annotated[Path | None, typer.Option(help="run directory (default runs/<job>)")] = None,
    redis_url: Annotated[str | None, typer.Option(help="Redis holding the job state")] = None,
    project: Annotated[Path | None, typer.Option(help="BOINC project (its Redis)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Show a job's state: epoch, units per state, latest accuracy, rejected results."""
    from boinc_dl.server.run.status import job_status, render_status

    try:
        if project is not None:
            redis_url = redis_url_for(redis_url, project)
        dirs: list[Path | None]
        if redis_url:
            dirs = [None]
        elif run_dir is not None:
            dirs = [run_dir]
        elif job is not None and _names_a_run_dir(job):
            dirs, job = [Path(job)], None  # `boinc-dl status runs/myjob`: every job of that run
        elif job is not None:
            dirs = [Path("runs") / job]
        else:
            dirs = sorted(p.parent for p in Path("runs").glob("*/redis")) or [None]
            if dirs == [None]:
                raise BoincDLError("no runs found under ./runs; give a job name, --run-dir or --redis-url")
        found: list[dict] = []
        for d in dirs:
            with _open_store_redis(d, redis_url) as r:
                from boinc_dl.server.assimilator.store import JobStore

                names = [job] if job else JobStore.list_jobs(r)
                for name in names:
                    st = job_status(JobStore(r, name).require())
                    if d is not None:
                        st["run_dir"] = str(d)
                    found.append(st)
                    if not as_json:
                        render_status(console, st)
        if not found:
            raise UnknownJob(f"no job {job!r} found" if job else "no jobs found")
        if as_json:
            import json

            # one JSON document whatever was found: a job's object, or an array of them
            console.print_json(json.dumps(found[0] if len(found) == 1 else found, default=str))
    except BoincDLError as e:
        _fail(e)


@app.command()
def cancel(
    job: Annotated[str, typer.Argument(help="job name")],
    run_dir: Annotated[Path | None, typer.Option(help="run directory (default runs/<job>)")] = None,
    redis_url: Annotated[str | None, typer.Option(help="Redis holding the job state")] = None,
    project: Annotated[Path | None, typer.Option(help="BOINC project: also cancel its workunits")] = None,
) -> None:
    """Cancel a job: no new units are created; a running generator stops at its next step."""
    from boinc_dl.server.assimilator.store import JobStore

    try:
        if project is not None:
            from boinc_dl.server.backends.boinc.submit import cancel_job

            was, n = cancel_job(project, job)
            done = f"job {job} already {was}: not cancelled" if was else f"job {job} cancelled"
            console.print(f"{done} ({n} workunit(s) cancelled in BOINC)")
            return
        with _open_store_redis(run_dir or Path("runs") / job, redis_url) as r:
            was = JobStore(r, job).require().cancel()
        # A finished job keeps its status (and its outputs' story): nothing left to stop.
        console.print(f"job {job} already {was}: nothing to cancel" if was else f"job {job} cancelled")
    except BoincDLError as e:
        _fail(e)


@app.command()
def validate(spec_file: Annotated[Path, typer.Argument(help="job spec (YAML)")]) -> None:
    """Check a job spec (and that its dataset and model can be loaded) without running it;
    show the settings a run would use, the derived defaults among them."""
    from boinc_dl.server.common.datasets import load_dataset
    from boinc_dl.server.common.spec import load_spec, local_options
    from boinc_dl.server.common.spec_checks import check_model_fits, check_resources, check_split
    from boinc_dl.server.common.spec_defaults import derive

    try:
        spec = load_spec(spec_file)
        check_resources(spec)
        # boinc-dl's own dataset loader (bandit takes it for Hugging Face's load_dataset)
        data = load_dataset(spec.dataset, spec.seed)  # nosec B615
        check_split(spec, len(data.x_train))
        opts = local_options(spec)
        slots = int(opts["workers"]) * int(opts["slots"]) if spec.backend.kind == "local" else None
        spec, chosen = derive(spec, len(data.x_train), slots)
        check_split(spec, len(data.x_train))
        from boinc_dl.server.common.keras_model import build_model, model_fingerprint

        model = build_model(spec.model, spec.model_args, spec_file.resolve().parent)
        fp = model_fingerprint(model)
        check_model_fits(tuple(model.inputs[0].shape[1:]) if getattr(model, "inputs", None) else (),
                         tuple(model.outputs[0].shape[1:]) if getattr(model, "outputs", None) else (),
                         tuple(data.x_train.shape[1:]), data.n_classes)
    except BoincDLError as e:
        _fail(e)
        return
    t = Table(show_header=False, title=f"{spec.name}: spec OK")
    t.add_row("mode", spec.mode)
    t.add_row("train / val examples", f"{len(data.x_train)} / {len(data.x_val)}")
    t.add_row("model parameters", f"{fp.n_params:,} in {len(fp.tensors)} tensors")
    tr = spec.training
    t.add_row("training", f"{tr.epochs} epochs, batch {tr.batch_size}, {tr.optimizer} lr {tr.learning_rate:g}, "
                          f"{tr.local_epochs} local epoch(s) per unit")
    if spec.mode == "vcasgd":
        v = spec.vcasgd
        rule = {"delta": f"delta (server lr {v.server_lr:g}, staleness power {v.staleness_power:g})",
                "search": f"search (0, delta's step or 4, 16, 64 times it, chosen by the loss of {v.search_batch} "
                          f"training examples at the server's weights; delta's after {v.search_wait_s:g} s)",
                "fedasync": f"fedasync (alpha {v.alpha}, staleness power {v.staleness_power:g})",
                "paper": f"the paper's (alpha {v.alpha})"}[v.merge_rule or "delta"]
        t.add_row("vcasgd", f"{v.n_subsets} subsets per epoch, merge rule {rule}, {v.merge}")
    elif spec.mop is not None:
        t.add_row("mop", f"{spec.mop.search} search, {spec.mop.partitions} partitions")
    if spec.backend.kind == "local":
        t.add_row("local backend", f"{opts['workers']} hosts x {opts['slots']} slots, "
                                   f"{opts['assimilators']} assimilators")
    for c in chosen:
        t.add_row(f"derived {c.field}", f"{c.value} ({c.why})")
    for label, text in _result_check_rows(spec, len(data.x_val)):
        t.add_row(label, text)
    console.print(t)


def _result_check_rows(spec: JobSpec, n_val: int) -> list[tuple[str, str]]:
    """What ``validation`` will do to the hosts' results, in words (docs/merge-rules.md);
    ``n_val``: the validation split's examples (the held-out batch is at most those)."""
    from boinc_dl.server.assimilator import losscheck as lc
    from boinc_dl.server.assimilator import rules

    v = spec.validation
    checks = [f"update norm at most {v.max_update_norm:g}" if v.max_update_norm else "no update-norm cap"]
    checks.append(f"updates clipped to {v.clip_factor:g}x the median norm of trusted ones (frozen per epoch) "
                  f"once {v.clip_min_trusted} exist" if v.clip_factor else "no clipping")
    rows = [("result checks", "; ".join(checks))]
    if spec.backend.kind == "local":
        rows.append(("refused results", f"the unit runs again on another slot, within units.max_error_results "
                                        f"({spec.units.max_error_results})"))
    elif spec.mode == "vcasgd" and spec.vcasgd.reissue == "fresh" and v.reissue_refused:
        rows.append(("refused results", f"the unit runs again from the freshest weights, at most {v.reissue_refused} "
                                        f"time(s) (within units.max_total_results, {spec.units.max_total_results}), "
                                        "then its subset is skipped for the epoch"))
    else:
        why = "validation.reissue_refused 0" if spec.mode == "vcasgd" and spec.vcasgd.reissue == "fresh" else (
            "vcasgd.reissue same" if spec.mode == "vcasgd" else "MOP")
        rows.append(("refused results", f"the unit is given up ({why})"))
    if spec.mode != "vcasgd":
        return rows
    if not lc.enabled(spec):
        rows.append(("loss check", "off (validation.loss_check)"))
        return rows
    if spec.backend.kind != "boinc":
        rows.append(("loss check", "BOINC only (backend: {kind: boinc}, or submit --backend boinc): the local "
                                   "backend's hosts are yours, every result trusted"))
        return rows
    needed = lc.trusted_needed(spec)
    rows.append(("loss check", f"an untrusted result is refused when it raises the loss of "
                               f"{min(v.loss_check_batch, n_val)} "
                               f"held-out examples more than median + {v.loss_check_k:g} MADs of trusted results' "
                               f"changes from bases at most {rules.BOUND_BASE_RATIO:g}x as bad as its own "
                               f"(too few such: more than {v.loss_check_k:g} MADs of the latest, from 0); "
                               f"active once {needed} trusted (replicated) results are measured"))
    rows.append(("host ledgers", f"a host is refused once its balance passes {v.loss_ledger_limit:g} "
                                 f"(slack {v.loss_ledger_slack:g})" if v.loss_ledger else "off (validation.loss_ledger)"))
    every = v.loss_check_spot_every
    rows.append(("spot checks", f"on a min_quorum 1 project, a unit is replicated on a second host until {needed} "
                                f"trusted results are measured, then after every {every} results judged against "
                                "worse models" if every else "off: replicate with the app's target_nresults"))
    return rows
