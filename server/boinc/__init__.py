"""BOINC production path: project install, create_work driver, daemons and result scripts.

* :mod:`server.boinc.project` — a BOINC project directory: its layout, ``config.xml``
  settings, the download/upload hierarchy and boinc-dl's own settings file;
* :mod:`server.backends.boinc` — the job system that stages files and creates
  workunits with ``bin/create_work`` (and cancels them with ``bin/cancel_jobs``);
* :mod:`server.boinc.scripts` — the programs BOINC's ``script_validator`` and
  ``script_assimilator`` call (argument forms of server releases 1.2 and 1.6);
* :mod:`server.boinc.install` — ``boinc-dl boinc install``: app, app versions,
  templates, plan class, daemons in ``config.xml``, idempotently (XML merged by
  :mod:`server.boinc.xmlmerge`, files described in :mod:`server.boinc.artifacts`);
* :mod:`server.boinc.daemon` — the work generator daemon;
* :mod:`server.boinc.submit` — submit / cancel a job on a project.
"""
