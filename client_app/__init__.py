"""The boinc-dl client app: trains one workunit in a BOINC slot directory.

``python -m boinc_dl.client_app`` (see :mod:`boinc_dl.client_app.cli`) or, in-process,
:func:`boinc_dl.client_app.train.run_unit`.
"""
