"""``python -m boinc_dl.server.backends.boinc ...``: the BOINC commands without the rest of the CLI.

The shims in the project's ``bin/`` use this form: it needs no console script on
PATH (bin/start runs daemons from cron with a minimal environment).

BOINC's ``script_validator`` and ``script_assimilator`` start a fresh interpreter for
every result they hand over, so ``assimilate``, ``validate-init`` and
``validate-compare`` take a fast path (:mod:`boinc_dl.server.backends.boinc.script_entry`:
argparse, no Typer, no CLI package, no work generator); every other command goes
through the full ``boinc-dl boinc`` app.
"""

import sys

from boinc_dl.server.backends.boinc.script_entry import SCRIPT_COMMANDS, run_script

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in SCRIPT_COMMANDS:
        sys.exit(run_script(sys.argv[1], sys.argv[2:]))
    from boinc_dl.server.cli.boinc import boinc_app

    boinc_app(prog_name="boinc-dl boinc")
