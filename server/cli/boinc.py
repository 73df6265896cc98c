"""``boinc-dl boinc ...``: BOINC server commands (mounted by the main CLI).

The validator and assimilator commands are what BOINC's daemons run through the
shims in the project's ``bin/``; they take BOINC's arguments verbatim after ``--``
(``--error`` included) and exit with BOINC's codes (see :mod:`boinc_dl.server.backends.boinc.scripts`).
The same app also runs as ``python -m boinc_dl.server.backends.boinc``, which is how the shims call it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from boinc_dl.server.common.errors import BoincDLError

boinc_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="BOINC server integration: install, daemons, validator/assimilator scripts.")

_PASS = {"allow_extra_args": True, "ignore_unknown_options": True}

ProjectOpt = Annotated[Path | None, typer.Option(
    "--project", help="BOINC project directory (default: $BDL_PROJECT, else the nearest parent with config.xml)")]
TokensOpt = Annotated[str | None, typer.Option(
    "--tokens", help="the token list declared to the BOINC daemon, e.g. 'wu_name files' (default: guess)")]


def _fail(e: BoincDLError) -> None:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(e.exit_code)


def _project(path: Path | None):  # noqa: ANN202
    from boinc_dl.server.backends.boinc.project import BoincProject, find_project

    return BoincProject(path).require() if path else find_project()


@boinc_app.command()
def install(
    project: Annotated[Path, typer.Argument(help="BOINC project directory (holds config.xml)")],
    redis_url: Annotated[str | None, typer.Option(help="Redis URL written to <project>/boinc-dl.yaml")] = None,
    assimilators: Annotated[int, typer.Option(help="parallel script_assimilator daemons (--mod P i)")] = 2,
    app_version: Annotated[str, typer.Option(help="app version number (files are immutable: bump to change)")] = "1.0",
    wrapper: Annotated[Path | None, typer.Option(help="BOINC wrapper binary for x86_64-pc-linux-gnu")] = None,
    gpu: Annotated[bool, typer.Option(help="also an NVIDIA GPU app version (plan class bdl_nvidia)")] = True,
    min_quorum: Annotated[int | None, typer.Option(help="replicas per unit (2+ for untrusted volunteer hosts)")] = None,
    gzip_outputs: Annotated[bool | None, typer.Option(help="clients gzip their outputs before upload")] = None,
    command: Annotated[str | None, typer.Option(
        help="how the shims start boinc-dl (default: this Python with -m boinc_dl.server.backends.boinc)")] = None,
    db: Annotated[bool, typer.Option(help="run bin/xadd and bin/update_versions when needed")] = True,
    force_db: Annotated[bool, typer.Option(help="run bin/xadd and bin/update_versions even if nothing changed")] = False,
    next_rpc_delay: Annotated[float, typer.Option(
        help="config.xml <next_rpc_delay>: hosts ask again this many seconds after their last "
             "scheduler RPC, despite a work-fetch backoff (0 removes it)")] = 60.0,
    maintenance_delay: Annotated[float, typer.Option(
        help="config.xml <maintenance_delay>: how long a host that asks during a restart stays "
             "away (0 removes it: BOINC's 3600 s); every deadline is timeout_s plus the longer of this and "
             "the client's own 120 s backoff")] = 30.0,
    min_sendwork_interval: Annotated[int, typer.Option(
        min=0, help="config.xml <min_sendwork_interval>: every scheduler reply defers the host's next "
                    "request, a finished task's report included, by max(1.01 x N, N + 1) s (0: none)")] = 0,
    docker_wrapper: Annotated[list[str] | None, typer.Option(
        help="BOINC's docker_wrapper binary: adds Docker app versions (plan classes bdl_docker and, with --gpu, "
             "bdl_docker_nvidia) for hosts with Docker or Podman and nothing installed; once per platform, "
             "named as BOINC names it (..._x86_64-pc-linux-gnu, ..._windows_x86_64.exe) or PLATFORM=PATH")] = None,
    docker_base_image: Annotated[str, typer.Option(
        help="the image the hosts build on (a local one for offline sites)")] = "python:3.11-slim-bookworm",
    docker_build_arg: Annotated[list[str] | None, typer.Option(
        help="one more argument for the hosts' docker/podman build, e.g. PIP_INDEX_URL=... after "
             "--docker-build-arg=--build-arg (repeatable)")] = None,
    docker_wheel: Annotated[Path | None, typer.Option(
        help="boinc-dl's wheel for the image (default: built with pip wheel --no-deps from the installed "
             "source tree)")] = None,
    quorum_across: Annotated[str, typer.Option(
        help="with --min-quorum 2+: replicas of a unit go to different 'users' (volunteers) or only "
             "different 'hosts' (a fleet attached with one account)")] = "users",
    jobs_per_slot: Annotated[int, typer.Option(
        min=0, help="config_aux.xml: at most this many boincdl tasks in progress per CPU (and GPU) of "
                    "a host, so that every host gets work (0 removes the cap)")] = 1,
    checks: Annotated[bool, typer.Option(help="check the prerequisites (as 'boinc-dl boinc doctor')")] = True,
) -> None:
    """Set a BOINC project up for boinc-dl (idempotent: prints what it changed)."""
    import shlex

    from boinc_dl.server.backends.boinc.docker_app import DockerOptions, platform_of
    from boinc_dl.server.backends.boinc.install import InstallOptions
    from boinc_dl.server.backends.boinc.install import install as do_install

    try:
        docker = DockerOptions(wrappers=[platform_of(w) for w in docker_wrapper or []],
                               base_image=docker_base_image, build_args=list(docker_build_arg or []),
                               wheel=docker_wheel)
    except BoincDLError as e:
        _fail(e)
        return
    opts = InstallOptions(redis_url=redis_url, assimilators=assimilators, app_version=app_version,
                          wrapper=wrapper, gpu=gpu, min_quorum=min_quorum, gzip_outputs=gzip_outputs,
                          command=shlex.split(command) if command else None, run_db_tools=db, force_db=force_db,
                          next_rpc_delay_s=next_rpc_delay, maintenance_delay_s=maintenance_delay,
                          min_sendwork_interval_s=min_sendwork_interval, docker=docker,
                          quorum_across=quorum_across, jobs_per_slot=jobs_per_slot, checks=checks)
    try:
        report = do_install(project, opts)
    except BoincDLError as e:
        _fail(e)
        return
    for c in report.changes:
        typer.echo(f"  changed: {c}")
    if not report.changes:
        typer.echo(f"{project}: already up to date, nothing changed")
    for n in report.notes:
        typer.echo(f"  note: {n}")


@boinc_app.command()
def doctor(
    project: ProjectOpt = None,
    web_user: Annotated[str | None, typer.Option(
        help="the web server's user (default: Apache's APACHE_RUN_USER, else www-data/apache)")] = None,
) -> None:
    """Check what a BOINC project needs for boinc-dl and say how to fix each gap (exit 1 if any)."""
    from boinc_dl.server.backends.boinc.doctor import diagnose

    try:
        proj = _project(project)
        findings = diagnose(proj, web_user)
    except BoincDLError as e:
        _fail(e)
        return
    for f in findings:
        typer.echo(f.line())
    raise typer.Exit(0 if all(f.ok for f in findings) else 1)


@boinc_app.command("work-generator")
def work_generator(
    project: ProjectOpt = None,
    once: Annotated[bool, typer.Option("--once", help="one pass, then exit")] = False,
    poll: Annotated[float | None, typer.Option(help="seconds between passes (default: settings poll_s)")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """The work generator daemon (exits on the stop_daemons file, SIGHUP, SIGTERM)."""
    from boinc_dl.server.backends.boinc.daemon import WorkGeneratorDaemon, setup_logging

    try:
        proj = _project(project)
        setup_logging(proj, verbose)
        d = WorkGeneratorDaemon(proj, poll)
        d.install_signals()
        code = d.run(once=once)
    except BoincDLError as e:
        _fail(e)
        return
    if not once:
        # stopped by the stop_daemons file: leave without the interpreter's teardown,
        # which takes seconds with TensorFlow loaded while bin/start waits for the lock
        import logging
        import os

        logging.shutdown()
        os._exit(code)
    raise typer.Exit(code)


def _script(kind: str, project: Path | None, tokens: str | None, args: list[str]) -> None:
    from boinc_dl.server.backends.boinc import scripts

    scripts.setup_logging(f"bdl_{kind}")
    try:
        proj = _project(project)
    except BoincDLError as e:
        typer.echo(f"bdl_{kind}: error: {e}", err=True)
        raise typer.Exit(scripts.EXIT_TRANSIENT) from None
    fn = {"assimilate": scripts.assimilate, "validate": scripts.validate_init,
          "compare": scripts.validate_compare}[kind]
    raise typer.Exit(fn(proj, args, tokens.split() if tokens else None))


@boinc_app.command(context_settings=_PASS)
def assimilate(
    ctx: typer.Context,
    project: ProjectOpt = None,
    tokens: TokensOpt = None,
    args: Annotated[list[str] | None, typer.Argument(help="what script_assimilator passes")] = None,
) -> None:
    """script_assimilator's script: merge a result (0), or exit non-zero on a transient fault."""
    _script("assimilate", project, tokens, [*(args or []), *ctx.args])


@boinc_app.command("validate-init", context_settings=_PASS)
def validate_init(
    ctx: typer.Context,
    project: ProjectOpt = None,
    tokens: TokensOpt = None,
    args: Annotated[list[str] | None, typer.Argument(help="what script_validator passes")] = None,
) -> None:
    """script_validator's init script: 0 valid, 3 transient, 1 invalid."""
    _script("validate", project, tokens, [*(args or []), *ctx.args])


@boinc_app.command("validate-compare", context_settings=_PASS)
def validate_compare(
    ctx: typer.Context,
    project: ProjectOpt = None,
    tokens: TokensOpt = None,
    args: Annotated[list[str] | None, typer.Argument(help="what script_validator passes")] = None,
) -> None:
    """script_validator's compare script: 0 match, 1 no match, 3 transient."""
    _script("compare", project, tokens, [*(args or []), *ctx.args])


@boinc_app.command()
def submit(
    spec_file: Annotated[Path, typer.Argument(help="job spec (YAML)")],
    project: Annotated[Path, typer.Option("--project", help="BOINC project directory")],
    resume: Annotated[bool, typer.Option("--resume", help="continue a job already recorded")] = False,
) -> None:
    """Submit a job to a BOINC project (the work generator daemon picks it up)."""
    from boinc_dl.server.backends.boinc.submit import submit_job
    from boinc_dl.server.common.spec import load_spec

    try:
        spec = load_spec(spec_file)
        job_dir = submit_job(spec, project, resume=resume, search_path=spec_file.resolve().parent)
    except BoincDLError as e:
        _fail(e)
        return
    typer.echo(f"job {spec.name} submitted to {project} (files in {job_dir})")


@boinc_app.command()
def cancel(
    job: Annotated[str, typer.Argument(help="job name")],
    project: Annotated[Path, typer.Option("--project", help="BOINC project directory")],
) -> None:
    """Cancel a job and its workunits in BOINC."""
    from boinc_dl.server.backends.boinc.submit import cancel_job

    try:
        was, n = cancel_job(project, job)
    except BoincDLError as e:
        _fail(e)
        return
    done = f"job {job} already {was}: not cancelled" if was else f"job {job} cancelled"
    typer.echo(f"{done} ({n} workunit(s) cancelled in BOINC)")


@boinc_app.command()
def spool(
    project: ProjectOpt = None,
    spool_dir: Annotated[Path | None, typer.Option(
        "--spool", help="spool directory (default: $BDL_SPOOL, else /var/lib/boinc-dl/spool)")] = None,
    queue: Annotated[str, typer.Option(help="'assimilate' (results) or 'validate' (validation requests)")] = "assimilate",
    mod: Annotated[tuple[int, int], typer.Option(help="N I: serve entries with crc32(name) % N == I")] = (1, 0),
    poll: Annotated[float, typer.Option(help="seconds between passes over an empty queue")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="one pass, then exit (exit 3 if Redis is down)")] = False,
) -> None:
    """The docker stack's assimilator: take the results BOINC's shims put in the spool
    through the one assimilation path (or answer validation requests with --queue validate)."""
    import os

    from boinc_dl.server.backends.boinc.spool import DEFAULT_SPOOL, serve

    if queue not in ("assimilate", "validate"):
        _fail(BoincDLError(f"--queue {queue!r}: choose assimilate or validate"))
    n, i = mod
    if not (n >= 1 and 0 <= i < n):
        _fail(BoincDLError(f"--mod {n} {i}: need N >= 1 and 0 <= I < N"))
    path = spool_dir or Path(os.environ.get("BDL_SPOOL") or DEFAULT_SPOOL)
    try:
        proj = _project(project) if queue == "assimilate" else None
    except BoincDLError as e:
        _fail(e)
        return
    raise typer.Exit(serve(path, proj, queue, (n, i), poll, once))


@boinc_app.command()
def restart(
    project: ProjectOpt = None,
    wait: Annotated[float, typer.Option(help="seconds to wait for the old daemons to exit")] = 120.0,
) -> None:
    """Restart the project's daemons safely: bin/stop, wait until they exited, bin/start,
    then check that every boinc-dl daemon runs (bin/start skips one still exiting)."""
    from boinc_dl.server.backends.boinc.restart import restart as do_restart

    try:
        proj = _project(project)
        rep = do_restart(proj, wait_s=wait)
    except BoincDLError as e:
        _fail(e)
        return
    for pid in rep.stragglers:
        typer.echo(f"warning: process {pid} had not exited after {wait:.0f}s", err=True)
    for cmd in rep.running:
        typer.echo(f"running: {cmd}")
    for cmd in rep.not_running:
        typer.echo(f"NOT running: {cmd} (see log_{proj.host}/ and run bin/start again)", err=True)
    raise typer.Exit(1 if rep.not_running else 0)
