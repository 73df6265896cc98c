"""``python -m server.backends.boinc ...``: the BOINC commands without the rest of the CLI.

The shims in the project's ``bin/`` use this form: it needs no console script on
PATH (bin/start runs daemons from cron with a minimal environment).
"""

from server.cli.boinc import boinc_app

if __name__ == "__main__":
    boinc_app(prog_name="boinc-dl boinc")
