"""The ``boinc-dl`` typer application and its consoles, shared by the command groups."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
import typer.core
from rich.console import Console
from rich.text import Text

from boinc_dl.server.common.errors import BoincDLError
from boinc_dl.server.common.spec import one_line
from boinc_dl.server.common.tf_env import quiet_env

# TensorFlow's start-up lines flood the terminal from every worker process; keep them
# in the run's log files instead (set TF_CPP_MIN_LOG_LEVEL yourself to see them).
quiet_env()



def _flags_without_values() -> None:
    """Show on/off flags as ``--resume``, not ``--resume <bool>``.

    typer 0.29's help gives every option its type, flags included (``--help <bool>``),
    which invites ``--resume true``, and a flag refuses a value. Flags get no type
    column here; every other option keeps its own. Other typer versions (whose options
    have no ``display_type_rich``) are left as they are.
    """
    option = getattr(typer.core, "TyperOption", None)
    shown = getattr(option, "display_type_rich", None)
    if option is None or shown is None or getattr(shown, "_bdl_flags", False):
        return

    def display_type_rich(self: Any, ctx: Any) -> str | None:
        if getattr(self, "is_flag", False) and not getattr(self, "count", False):
            return None
        return shown(self, ctx)

    display_type_rich._bdl_flags = True  # type: ignore[attr-defined]
    option.display_type_rich = display_type_rich


_flags_without_values()

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Deep-learning training and model selection on BOINC and preemptible VMs.")
console = Console()
err_console = Console(stderr=True)


def error_line(message: str) -> None:
    """``error: message`` on stderr as one line, whatever the terminal's width (no
    wrapping; brackets in the message are not markup)."""
    err_console.print(Text.assemble(("error:", "red"), " ", one_line(str(message), limit=2000)),
                      soft_wrap=True, highlight=False)


def redis_url_for(redis_url: str | None, project: Path | None = None) -> str:
    """The Redis a command works on: ``--redis-url``, else ``$BDL_REDIS_URL``, else the
    ``--project``'s ``boinc-dl.yaml`` (one resolution for every command)."""
    if project is not None:
        from boinc_dl.server.backends.boinc.project import BoincProject

        return BoincProject(project).require().redis_url(redis_url)
    from boinc_dl.server.assimilator.connection import resolve_url

    return resolve_url(redis_url, where="--project's boinc-dl.yaml")


def fail(e: BoincDLError) -> None:
    """Print ``e`` as one line and exit with its code."""
    error_line(str(e))
    raise typer.Exit(e.exit_code)
