"""Wiring: the one place that picks a cloud provider for a fleet.yaml."""

from __future__ import annotations

from typing import Any

from boinc_dl.server.fleet.boinchosts import BoincHosts
from boinc_dl.server.fleet.config import FleetConfig
from boinc_dl.server.fleet.controller import FleetController


def build_controller(cfg: FleetConfig) -> FleetController:
    """Provider, BOINC database, Redis and controller for a validated config."""
    from boinc_dl.server.assimilator.connection import connect
    from boinc_dl.server.backends.boinc.project import BoincProject

    project = BoincProject(cfg.project).require()
    provider: Any
    if cfg.provider == "aws":
        from boinc_dl.server.fleet.aws import AwsProvider

        provider = AwsProvider(cfg.aws)
    else:
        from boinc_dl.server.fleet.gcp import GcpProvider

        provider = GcpProvider(cfg.gcp)
    return FleetController(cfg, provider, BoincHosts.from_project(project), connect(project.redis_url()))
