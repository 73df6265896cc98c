"""The ``boinc-dl`` typer application and its consoles, shared by the command groups."""

from __future__ import annotations

import os

import typer
from rich.console import Console

from server.common.errors import BoincDLError

# TensorFlow's C++ logging floods the terminal from every worker process; keep errors
# in the run's log files instead (set TF_CPP_MIN_LOG_LEVEL yourself to see them).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Deep-learning training and model selection on BOINC and preemptible VMs.")
console = Console()
err_console = Console(stderr=True)


def fail(e: BoincDLError) -> None:
    """Print ``e`` as one line and exit with its code."""
    err_console.print(f"[red]error:[/] {e}", markup=True, highlight=False)
    raise typer.Exit(e.exit_code)
