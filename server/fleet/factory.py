"""Wiring: the one place that picks a cloud provider for a fleet.yaml."""

from __future__ import annotations

from typing import Any

from boinc_dl.server.fleet.boinchosts import BoincHosts
from boinc_dl.server.fleet.config import FleetConfig
from boinc_dl.server.fleet.controller import FleetController
from boinc_dl.server.fleet.state import FleetState


def build_controller(cfg: FleetConfig) -> FleetController:
    """Provider, BOINC database, the fleet's Redis state and controller for a validated
    config."""
    from boinc_dl.server.assimilator.connection import connect
    from boinc_dl.server.backends.boinc.project import BoincProject

    project = BoincProject(cfg.project).require()
    provider: Any
    if cfg.provider == "aws":
        from boinc_dl.server.fleet.aws import AwsProvider

        provider = AwsProvider(cfg.aws)
    else:
        from boinc_dl.server.fleet.gcp import GcpProvider

        creds = None
        if cfg.gcp.credentials == "anonymous":
            from google.auth.credentials import AnonymousCredentials

            creds = AnonymousCredentials()
        provider = GcpProvider(cfg.gcp, credentials=creds)
    # wait_s: a daemon restarted while Redis restarts waits for it rather than exiting
    state = FleetState(connect(project.redis_url(), wait_s=30.0), cfg.fleet_name())
    return FleetController(cfg, provider, BoincHosts.from_project(project), state)
