"""The boinc-dl client app: trains one workunit in a BOINC slot directory.

``python -m client_app`` (see :mod:`client_app.cli`) or, in-process,
:func:`client_app.train.run_unit`.
"""
