"""BOINC production path: the one home of everything BOINC-specific.

* :mod:`.project` — a BOINC project directory: its layout, ``config.xml`` settings, the
  download/upload hierarchy and boinc-dl's own settings file;
* :mod:`.jobsystem` — the job system that stages files and creates workunits with
  ``bin/create_work`` (and cancels them with ``bin/cancel_jobs``);
* :mod:`.scripts` — the programs BOINC's ``script_validator`` and ``script_assimilator``
  call (argument forms of server releases 1.2 and 1.6);
* :mod:`.install` — ``boinc-dl boinc install``: app, app versions, templates, plan class,
  daemons in ``config.xml``, idempotently (XML merged by :mod:`.xmlmerge`, files described
  in :mod:`.artifacts`; the packaged ``templates/``, ``files/`` and the admin page in
  ``html/``);
* :mod:`.daemon` — the work generator daemon;
* :mod:`.submit` — submit / cancel a job on a project.

``python -m boinc_dl.server.backends.boinc ...`` runs the ``boinc-dl boinc`` commands (the shims
in a project's ``bin/`` use it). Modules import each other in one direction:
project <- xmlmerge <- artifacts <- install / jobsystem <- daemon <- submit; scripts
uses project and jobsystem.
"""

import importlib
from typing import Any

# Loaded on first use (PEP 562): BOINC's daemons start a fresh interpreter for every
# validator and assimilator call, and those need none of these (the daemon alone pulls
# in the work generators).
_EXPORTS = {
    "APP_NAME": "project", "BoincProject": "project", "BoincSettings": "project",
    "find_project": "project", "BoincJobSystem": "jobsystem", "BoincToolError": "jobsystem",
    "InstallOptions": "install", "install": "install", "WorkGeneratorDaemon": "daemon",
    "cancel_job": "submit", "submit_job": "submit",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "APP_NAME",
    "BoincJobSystem",
    "BoincProject",
    "BoincSettings",
    "BoincToolError",
    "InstallOptions",
    "WorkGeneratorDaemon",
    "cancel_job",
    "find_project",
    "install",
    "submit_job",
]
