"""Spot and preemptible cloud fleets for a BOINC project (AWS, GCP).

:mod:`~boinc_dl.server.fleet.controller` sizes the fleet to BOINC's queue, replaces reclaimed
instances, files early re-issues of their units and falls back to on-demand;
:mod:`~boinc_dl.server.fleet.aws` and :mod:`~boinc_dl.server.fleet.gcp` are the only cloud-specific
modules; :mod:`~boinc_dl.server.fleet.cost` accounts each job's cloud cost. See ``docs/fleet.md``.
"""
