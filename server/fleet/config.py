"""``fleet.yaml``: what the fleet controller drives and within which limits.

Validated with pydantic; every error is one line naming the field
(``fleet.yaml: fallback.threshold: Input should be less than or equal to 1``).
See ``docs/fleet.md`` and ``examples/fleet-aws.yaml`` / ``examples/fleet-gcp.yaml``.
"""

from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from boinc_dl.server.common.errors import BoincDLError
from boinc_dl.server.planner.fleetfile import FleetFile, FleetFileError, parse_fleet, read_yaml


class FleetConfigError(BoincDLError):
    """fleet.yaml is missing, unparsable or invalid."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AwsSettings(_Strict):
    """The auto scaling group (mixed instances policy) and the interruption queue."""

    region: str = Field(..., min_length=1)
    asg_name: str = Field(..., min_length=1, description="auto scaling group of the spot fleet")
    queue_url: str = Field(..., min_length=1, description="SQS queue fed by EventBridge (spot "
                           "interruption warnings and rebalance recommendations)")
    endpoint_url: str | None = Field(None, description="another endpoint (a local stand-in); "
                                     "empty: AWS itself")
    spot_history_s: float = Field(86400.0, gt=0, description="how far back to read spot prices")


class GcpSettings(_Strict):
    """The SPOT managed instance group and, for the fallback, an on-demand one."""

    project: str = Field(..., min_length=1)
    zone: str = Field(..., min_length=1)
    mig: str = Field(..., min_length=1, description="managed instance group of SPOT VMs")
    machine_type: str = Field(..., min_length=1, description="the MIG template's machine type")
    on_demand_mig: str | None = Field(None, description="managed instance group of standard "
                                      "(on-demand) VMs used by the fallback")
    endpoint_url: str | None = Field(None, description="another API endpoint (a local stand-in)")
    credentials: Literal["default", "anonymous"] = Field("default", description="'default': Application "
                                                          "Default Credentials; 'anonymous': none (a local "
                                                          "stand-in at endpoint_url)")
    spot_prices: dict[str, Decimal] = Field(default_factory=dict, description="$/h of SPOT VMs by "
                                            "machine type (GCP publishes them; no history API)")


class FallbackSettings(_Strict):
    """Shift part of the fleet to on-demand while spot is refused or reclaimed too often."""

    window_s: float = Field(900.0, gt=0, description="window of the interruption rate")
    threshold: float = Field(0.1, gt=0, le=1, description="interruptions per running host over "
                             "the window that trigger the fallback")
    calm_ratio: float = Field(0.5, gt=0, lt=1, description="shift back once the rate is below "
                              "threshold * calm_ratio ...")
    hold_s: float = Field(1800.0, ge=0, description="... and nothing happened for this long")
    on_demand_percent: int = Field(50, ge=1, le=100, description="share of the fleet on "
                                   "on-demand during the fallback")
    base_on_demand_percent: int = Field(0, ge=0, le=100, description="share in calm times")

    @model_validator(mode="after")
    def _order(self) -> FallbackSettings:
        if self.base_on_demand_percent >= self.on_demand_percent:
            raise ValueError("base_on_demand_percent must be below on_demand_percent")
        return self


class FleetConfig(_Strict):
    """The whole of fleet.yaml."""

    provider: Literal["aws", "gcp"]
    aws: AwsSettings | None = None
    gcp: GcpSettings | None = None
    project: str = Field(..., min_length=1, description="the BOINC project directory")
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="the fleet's "
                             "name in Redis (bdl:fleet:{name}:...); default: the group's name")
    reclaim_action: Literal["drain", "terminate"] = Field(
        "drain", description="what happens to a warned instance once its units are re-issued: 'drain' takes "
        "it out of the group (a replacement starts now) and leaves it to the cloud, which does not bill a spot "
        "instance it reclaims in its first hour (AWS); 'terminate' stops it now (billed as the owner's stop)")
    lease_s: float = Field(15.0, ge=1, description="a controller's lease on the fleet: a restarted "
                           "controller waits at most this long for a dead one's to lapse")
    min_hosts: int = Field(0, ge=0)
    max_hosts: int = Field(..., ge=1)
    slots_per_host: int = Field(1, ge=1, description="units one host runs at once")
    budget_per_hour: Decimal | None = Field(None, gt=0, description="$/h the fleet may cost")
    period_s: float = Field(30.0, gt=0, description="seconds between control periods")
    interrupt_poll_s: float = Field(2.0, gt=0, description="seconds between looks for reclaims "
                                    "between periods (re-issue latency)")
    reissue_on_rebalance: bool = Field(False, description="re-issue on a rebalance "
                                       "recommendation too (it is only a risk signal)")
    on_demand_prices: dict[str, Decimal] = Field(default_factory=dict, description="$/h by "
                                                 "instance type; overrides the shipped table")
    fallback: FallbackSettings = Field(default_factory=FallbackSettings)
    planner: dict[str, Any] | None = Field(None, description="what `boinc-dl plan` may try "
                                           "with this fleet (the planner's schema, docs/planner.md)")

    @model_validator(mode="after")
    def _consistent(self) -> FleetConfig:
        if self.min_hosts > self.max_hosts:
            raise ValueError("min_hosts must not exceed max_hosts")
        if getattr(self, self.provider) is None:
            raise ValueError(f"provider is {self.provider} but the '{self.provider}' section is missing")
        if self.planner is not None:
            try:  # checked when the controller loads the file too, not only when planning
                self.planner_fleet(None)
            except FleetFileError as e:
                raise ValueError(f"planner section: {e}") from None
        return self

    def fleet_name(self) -> str:
        """The fleet's name in Redis: ``name``, else the (spot) group's name."""
        if self.name:
            return self.name
        group = self.aws.asg_name if self.provider == "aws" and self.aws else self.gcp.mig if self.gcp else ""
        # a group's name may hold characters a key's hash tag must not (e.g. braces)
        return re.sub(r"[^A-Za-z0-9._-]", "-", group).lstrip("-._")[:64] or "fleet"

    def planner_types(self) -> list[str]:
        """The instance types this file names: the GCP group's machine type, its SPOT
        prices' types, and the types given on-demand prices."""
        names = [*self.on_demand_prices]
        if self.gcp is not None:
            names = [self.gcp.machine_type, *self.gcp.spot_prices, *names]
        return list(dict.fromkeys(names))

    def planner_fleet(self, base_dir: Path | None) -> FleetFile:
        """This file as the planner's fleet: its ``planner:`` section, with the
        controller's own fields as defaults — the types it names (at most ``max_hosts``
        each, relative speed 1 unless the section says otherwise), T = ``slots_per_host``,
        and its on-demand and SPOT prices over the shipped table's."""
        cap = min(self.max_hosts, 64)
        defaults: dict[str, Any] = {"types": {t: {"max_count": cap} for t in self.planner_types()},
                                    "slots": [self.slots_per_host]}
        ff = parse_fleet(self.planner or {}, base_dir, "fleet.yaml: planner", defaults)
        ff.on_demand_prices = {k: float(v) for k, v in self.on_demand_prices.items()}
        ff.spot_prices = {k: float(v) for k, v in self.gcp.spot_prices.items()} if self.gcp else {}
        return ff


def _one_line(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    return f"{where}: {err['msg']}{more}"


def parse_config(data: object, source: str = "fleet.yaml") -> FleetConfig:
    """Validate an already-parsed fleet.yaml; a one-line :class:`FleetConfigError` if bad."""
    if not isinstance(data, dict):
        raise FleetConfigError(f"{source}: expected a mapping at the top level")
    try:
        return FleetConfig.model_validate(data)
    except ValidationError as e:
        raise FleetConfigError(f"{source}: {_one_line(e)}") from None


def load_config(path: str | Path) -> FleetConfig:
    """Read and validate ``path`` (YAML, at most 1 MiB)."""
    p = Path(path)
    try:
        if p.stat().st_size > 1 << 20:
            raise FleetConfigError(f"{p}: larger than 1 MiB")
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise FleetConfigError(f"{p}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise FleetConfigError(f"{p}: not valid YAML ({str(e).splitlines()[0]})") from None
    return parse_config(data, str(p))


def load_planner_fleet(path: str | Path) -> FleetFile:
    """The planner's fleet from either form of fleet file: the controller's ``fleet.yaml``
    (validated as the controller validates it, then :meth:`FleetConfig.planner_fleet`)
    or a planner-only file. Raises :class:`FleetFileError` or :class:`FleetConfigError`."""
    p = Path(path)
    raw = read_yaml(p)
    if isinstance(raw, dict) and "provider" in raw:
        return parse_config(raw, str(p)).planner_fleet(p.parent)
    return parse_fleet(raw, p.parent, str(p))
