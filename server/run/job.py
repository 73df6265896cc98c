"""``boinc-dl run``: a whole job on the embedded local backend, start to finish.

Claims the run directory (:mod:`boinc_dl.server.run.rundir`: an exclusive lock,
``--new`` / ``--overwrite``), owns the private Redis (see
:func:`~boinc_dl.server.run.lifecycle.open_store`) for both modes and hands the job to
:mod:`boinc_dl.server.run.vcasgd` or :mod:`boinc_dl.server.run.mop`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rich.console import Console

from boinc_dl.server.common import diskfaults
from boinc_dl.server.common.spec import JobSpec
from boinc_dl.server.run.lifecycle import (
    RunResult,
    default_run_dir,
    open_store,
    pause_job,
    setup_logging,
)
from boinc_dl.server.run.rundir import OnExisting, claim
from boinc_dl.server.run.vcasgd import run_vcasgd

log = logging.getLogger(__name__)


def run_job(spec: JobSpec, run_dir: Path | None = None, resume: bool = False, redis_url: str | None = None,
            console: Console | None = None, live: bool = True, backend_opts: dict[str, Any] | None = None,
            search_path: Path | None = None, on_existing: OnExisting | None = None,
            lines: bool = False) -> RunResult:
    """Run ``spec`` on the local backend; see the module docstring.

    ``on_existing`` says what to do with a run already in the directory (``refuse``,
    ``resume``, ``new``, ``overwrite``; default from ``resume``). ``live`` redraws a
    progress view; ``lines`` prints a plain line per epoch instead (output that is not
    a terminal)."""
    console = console or Console()
    how: OnExisting = on_existing or ("resume" if resume else "refuse")
    claimed = claim(spec, Path(run_dir or default_run_dir(spec)), how)
    spec, run_dir = claimed.spec, claimed.run_dir
    resume = how == "resume"
    try:
        setup_logging(run_dir)
        if claimed.numbered:
            console.print(f"a fresh run beside the earlier one: job [cyan]{spec.name}[/] in {run_dir}")
        server, redis_url, store = open_store(run_dir, redis_url, spec.name)
        try:
            if how == "overwrite" and store.exists():  # a shared Redis: the run dir held none of it
                store.delete()
            if spec.mode != "vcasgd":
                from boinc_dl.server.run.mop import run_mop_job  # noqa: PLC0415 - MOP is optional

                res = run_mop_job(spec, run_dir, resume, redis_url, store, console, live, backend_opts,
                                  search_path, lines=lines)
            else:
                res = run_vcasgd(spec, run_dir, resume, redis_url, store, console, live, backend_opts, search_path,
                                 lines=lines)
            res.job = spec.name
            return res
        except Exception as e:
            # A full disk while preparing or writing outputs: the same one line as mid-run.
            fault = diskfaults.as_server_error(e, run_dir)
            if fault is None:
                raise
            raise pause_job(store, fault) from None
        finally:
            if server is not None:  # also when the job could not even be prepared
                server.stop()
    finally:
        claimed.release()
