"""The validator/assimilator commands as BOINC's daemons call them, started fast.

``script_assimilator`` and ``script_validator`` run ``bin/bdl_assimilate`` (and the
validator's scripts) through ``system()`` once per result, so the interpreter's start-up
is paid on every result, twice per unit (validate, then assimilate), between the
client's report and the merge. This entry point parses the same options as
``boinc-dl boinc assimilate|validate-init|validate-compare`` with argparse and imports
only :mod:`boinc_dl.server.backends.boinc.scripts` (not Typer, the CLI package or the work
generators). Options and exit codes are the same as the Typer commands'.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

#: command -> the kind :mod:`boinc_dl.server.backends.boinc.scripts` knows it by
SCRIPT_COMMANDS = {"assimilate": "assimilate", "validate-init": "validate", "validate-compare": "compare"}


def _parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog=f"boinc-dl boinc {command}",
        description=f"What BOINC's {'script_assimilator' if command == 'assimilate' else 'script_validator'} "
                    "calls: BOINC's own arguments follow '--' (see server/backends/boinc/scripts.py).")
    p.add_argument("--project", type=Path, default=None,
                   help="BOINC project directory (default: $BDL_PROJECT, else the nearest parent with config.xml)")
    p.add_argument("--tokens", default=None,
                   help="the token list declared to the BOINC daemon, e.g. 'wu_name files' (default: guess)")
    return p


def run_script(command: str, argv: Sequence[str]) -> int:
    """Run one validator/assimilator call; returns BOINC's exit code."""
    kind = SCRIPT_COMMANDS[command]
    # like the Typer command (ignore_unknown_options): our options, then BOINC's arguments
    # verbatim, '--error' included
    args, rest = _parser(command).parse_known_args(list(argv))
    if rest and rest[0] == "--":
        rest = rest[1:]
    from boinc_dl.server.backends.boinc import scripts
    from boinc_dl.server.backends.boinc.project import BoincProject, find_project
    from boinc_dl.server.common.errors import BoincDLError

    scripts.setup_logging(f"bdl_{kind}")
    try:
        project = BoincProject(args.project).require() if args.project else find_project()
    except BoincDLError as e:
        print(f"bdl_{kind}: error: {e}", file=sys.stderr)
        return scripts.EXIT_TRANSIENT
    fn = {"assimilate": scripts.assimilate, "validate": scripts.validate_init,
          "compare": scripts.validate_compare}[kind]
    return int(fn(project, rest, args.tokens.split() if args.tokens else None))
