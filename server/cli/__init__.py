"""The ``boinc-dl`` command line: a thin layer over :mod:`boinc_dl.server.run` and the backends.

One module per command group, mounted here on :data:`boinc_dl.server.cli.app.app`:

* :mod:`.jobs` — ``run``, ``submit``, ``status``, ``cancel``, ``validate``;
* :mod:`.boinc` — ``boinc-dl boinc ...`` (install, daemons, validator/assimilator scripts);
* :mod:`.fleet` — ``boinc-dl fleet ...`` (the spot fleet controller) and ``boinc-dl cost JOB``;
* :mod:`.plan` — ``boinc-dl plan`` (predicted time and cost of fleets, the recommended one);
* :mod:`.redis_admin` — ``boinc-dl redis ...`` (check a Redis's persistence, flush its AOF).

Further groups go beside these: a module with its own ``typer.Typer`` added with
``app.add_typer`` below.
"""

from __future__ import annotations

import faulthandler
import sys

from boinc_dl.server.cli import jobs  # noqa: F401 - registers the job commands on ``app``
from boinc_dl.server.cli.app import app, err_console
from boinc_dl.server.cli.plan import plan
from boinc_dl.server.cli.redis_admin import redis_app

app.command(name="plan")(plan)
app.add_typer(redis_app, name="redis")


def _mount_optional() -> None:
    """Sub-commands that live in optional parts of the package (BOINC integration)."""
    try:
        from boinc_dl.server.cli.boinc import boinc_app
    except ImportError:
        return
    app.add_typer(boinc_app, name="boinc", help="BOINC server integration (install, daemons, scripts).")
    from boinc_dl.server.cli.fleet import cost, fleet_app

    app.add_typer(fleet_app, name="fleet")
    app.command("cost")(cost)


_mount_optional()


def main() -> None:
    """Console-script entry point."""
    # A fatal signal inside a native library (TensorFlow, h5py) prints every thread's
    # Python stack on stderr before the process dies, so the crash names where it was.
    faulthandler.enable()
    try:
        app()
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


__all__ = ["app", "main"]
