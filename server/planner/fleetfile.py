"""``fleet.yaml`` for the planner: the instance types a user may use and the choices to try.

    types:                         # instance type -> how a unit runs there
      g4dn.xlarge: {unit_s: 6.0, cores: 4, max_count: 4, preempt_p: 0.05, bandwidth_mbps: 5000}
      c6i.xlarge:  {speed: 0.25, cores: 4, max_count: 8, preempt_p: 0.03}
    markets: [spot, on-demand]
    slots: [1, 2, 4]               # T
    assimilators: [1, 2, 4]        # P
    units_per_epoch: [8, 16]       # unit size (default: the spec's n_subsets)
    server: {type: c6i.xlarge}     # priced on-demand for the whole job
    costs: {merge_s: 0.3, stage_s: 0.1, dispatch_s: 0.05, speedup: {2: 1.6, 4: 2.2}}
    params: 4972746                # model size (default: built from the spec)
    spot_history: spot.json        # optional: [{type, zone, time, usd_per_hour}, ...]

``unit_s`` is one unit's compute alone on one slot at the spec's unit size; ``speed``
instead scales a calibrated unit time (``unit_s = calibrated / speed``).

One file for the planner and the fleet controller: the controller's ``fleet.yaml``
(``server/fleet/config.py``) takes this schema under its ``planner:`` key, and
``server.fleet.config.load_planner_fleet`` reads it with the controller's own fields
as defaults (instance types and prices, host limit, slots per host). A file with this
schema at the top level is the planner-only form: planning comes before a fleet exists,
when there is no auto scaling group, queue or project to name yet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from boinc_dl.server.planner.model import (
    SHARED_MERGE_RATIO,
    HostType,
    ServerCosts,
    merge_estimate_s,
)
from boinc_dl.server.planner.prices import MARKETS


class FleetFileError(ValueError):
    """A fleet.yaml that cannot be used, with the field at fault."""


@dataclass
class FleetFile:
    """A parsed fleet.yaml (see module docstring)."""

    types: dict[str, dict[str, Any]]
    markets: tuple[str, ...] = MARKETS
    slots: tuple[int, ...] = (1, 2, 4)
    assimilators: tuple[int, ...] = (1, 2, 4)
    units_per_epoch: tuple[int, ...] = ()
    server_type: str | None = None
    costs: dict[str, Any] = field(default_factory=dict)
    params: int | None = None
    spot_history: list[Any] = field(default_factory=list)
    on_demand_prices: dict[str, float] = field(default_factory=dict)  # a controller file's
    spot_prices: dict[str, float] = field(default_factory=dict)  # published SPOT prices (GCP)

    def host_types(self, calibrated_unit_s: float | None) -> tuple[list[HostType], list[int]]:
        """The HostTypes and their max counts; ``speed`` entries need a calibrated unit time."""
        hosts, counts = [], []
        for name, row in self.types.items():
            if "unit_s" in row:
                unit_s = float(row["unit_s"])
            elif calibrated_unit_s is not None:
                unit_s = calibrated_unit_s / float(row.get("speed", 1.0))
            else:
                raise FleetFileError(f"types.{name}: give unit_s, or calibrate (--calibrate RUN_DIR, or a calibration run here)")
            hosts.append(HostType(name, unit_s, int(row.get("cores", 4)), float(row.get("bandwidth_mbps", 1000.0)),
                                  float(row.get("preempt_p", 0.05))))
            counts.append(int(row.get("max_count", 4)))
        return hosts, counts

    def server_costs(self, model_bytes: int, cal: Any = None) -> ServerCosts:
        """Server-side costs: the file's, else a calibration's (a past run's recorded
        per-merge durations: :class:`~boinc_dl.server.planner.calibrate.Calibration`),
        else an estimate from the model size
        (:func:`~boinc_dl.server.planner.model.merge_estimate_s`).

        With a ``speedup`` table the plain model is used (P merges ``speedup[P]`` times
        as fast); without one, the resource-sharing model: P merges share the server's
        ``server_cores`` cores (default 2), each of ``merge_shared_s`` CPU seconds when
        P > 1 (default: ``merge_s`` times the ratio measured by the planner bench), and
        the generator's ``create_s`` per unit (default 0) and Redis' ``commit_s`` per merge,
        served one at a time (default: the calibration's, else 0: not modelled). The
        clients are other machines, so their staging is theirs, not the server's: the
        calibration's per-unit overhead outside training, else an estimate.

        A BOINC job's calibration (``cal.boinc``, from BOINC's result table) adds what
        BOINC measured around the app: its host-side overhead per unit (the wrapper, a
        container's start) to the staging, and the network and queue time of each unit
        (turnaround - elapsed) as its dispatch latency (default 0.05 s without it)."""
        c = self.costs
        cal_merge = getattr(cal, "merge_s", None)
        m = float(c["merge_s"]) if "merge_s" in c else cal_merge if cal_merge is not None else \
            merge_estimate_s(model_bytes)
        cal_stage = getattr(cal, "overhead_s", None)
        if cal_stage is not None:
            cal_stage += getattr(cal, "host_overhead_s", 0.0)
        stage = float(c.get("stage_s", cal_stage if cal_stage is not None else 0.02 + 2 * model_bytes / 500e6))
        boinc = getattr(cal, "boinc", None)
        dispatch = float(c.get("dispatch_s", boinc.network_queue_s if boinc is not None else 0.05))
        cores = int(c.get("server_cores", 2))
        if c.get("speedup"):
            speed = {int(k): float(v) for k, v in c["speedup"].items()}
            speed.setdefault(1, 1.0)
            return ServerCosts(m, speed, stage, dispatch, cores)
        shared = float(c.get("merge_shared_s", m * SHARED_MERGE_RATIO))
        commit = float(c.get("commit_s", getattr(cal, "commit_s", None) or 0.0))
        return ServerCosts(m, {}, stage, dispatch, cores, cpu_cores=cores, merge_shared_s=shared,
                           create_s=float(c.get("create_s", 0.0)), commit_s=commit)


def _ints(raw: Any, key: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not raw or not all(isinstance(x, int) and 0 < x <= 1024 for x in raw):
        raise FleetFileError(f"{key}: a non-empty list of positive integers expected")
    return tuple(raw)


COST_KEYS = {"merge_s", "merge_shared_s", "create_s", "commit_s", "stage_s", "dispatch_s", "server_cores"}
MAX_FILE_BYTES = 1 << 20  # a fleet file is small; refuse to parse anything bigger


def load_fleet(path: Path | str) -> FleetFile:
    """Read and check a planner-only fleet file (the schema above at the top level).

    A fleet controller's ``fleet.yaml`` (it has ``provider:``) carries the same schema
    under ``planner:``; read it with ``server.fleet.config.load_planner_fleet``, which
    also takes the controller's prices and limits (the planner may not import the fleet).
    """
    p = Path(path)
    raw = read_yaml(p)
    if isinstance(raw, dict) and "provider" in raw:
        raise FleetFileError(f"{p}: a fleet controller file (provider: ...): "
                             "load it with boinc_dl.server.fleet.config.load_planner_fleet")
    return parse_fleet(raw, p.parent, str(p))


def read_yaml(p: Path) -> Any:
    """A fleet file's YAML, bounded in size."""
    try:
        if p.stat().st_size > MAX_FILE_BYTES:
            raise FleetFileError(f"{p}: larger than 1 MiB")
        return yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise FleetFileError(f"{p}: {e}") from None


def parse_fleet(raw: Any, base_dir: Path | None, where: str = "fleet.yaml",
                defaults: dict[str, Any] | None = None) -> FleetFile:
    """Check the planner's schema in an already-parsed mapping.

    ``defaults`` fills keys the mapping lacks (a controller file's types, slots and host
    limits); ``base_dir`` is where ``spot_history`` is read from (None: only checked).
    """
    if not isinstance(raw, dict):
        raise FleetFileError(f"{where}: a mapping expected")
    raw = {**(defaults or {}), **raw}
    if not isinstance(raw.get("types"), dict) or not raw["types"]:
        raise FleetFileError(f"{where}: 'types' must map instance types to their settings")
    for name, row in raw["types"].items():
        if not isinstance(row, dict):
            raise FleetFileError(f"types.{name}: a mapping expected")
        for k in ("unit_s", "speed", "bandwidth_mbps"):
            if k in row and not (isinstance(row[k], (int, float)) and row[k] > 0):
                raise FleetFileError(f"types.{name}.{k}: a positive number expected")
        try:
            preempt_p, max_count = float(row.get("preempt_p", 0)), int(row.get("max_count", 4))
        except (TypeError, ValueError):
            raise FleetFileError(f"types.{name}: preempt_p and max_count must be numbers") from None
        if not 0 <= preempt_p < 1:
            raise FleetFileError(f"types.{name}.preempt_p: in [0, 1)")
        if not 1 <= max_count <= 64:
            raise FleetFileError(f"types.{name}.max_count: 1..64")
    ff = FleetFile({str(k): v for k, v in raw["types"].items()})
    if "markets" in raw:
        if not isinstance(raw["markets"], list) or not raw["markets"] or \
                not set(raw["markets"]) <= set(MARKETS):
            raise FleetFileError(f"markets: a list from {list(MARKETS)}")
        ff.markets = tuple(raw["markets"])
    for key in ("slots", "assimilators", "units_per_epoch"):
        if key in raw:
            setattr(ff, key, _ints(raw[key], key))
    if "server" in raw:
        ff.server_type = str((raw["server"] or {}).get("type")) if isinstance(raw["server"], dict) else None
    if not isinstance(raw.get("costs") or {}, dict):
        raise FleetFileError("costs: a mapping expected")
    ff.costs = dict(raw.get("costs") or {})
    for k, v in ff.costs.items():
        if k == "speedup":
            ok = isinstance(v, dict) and all(isinstance(x, (int, float)) and x > 0 for x in v.values())
        else:
            ok = k in COST_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e6
        if not ok:
            raise FleetFileError(f"costs.{k}: unknown, or not a non-negative number")
    if "params" in raw:
        if not isinstance(raw["params"], int) or raw["params"] <= 0:
            raise FleetFileError("params: a positive integer expected")
        ff.params = raw["params"]
    if raw.get("spot_history") and base_dir is not None:
        try:
            hist = json.loads((base_dir / str(raw["spot_history"])).read_text())
            ff.spot_history = [SimpleNamespace(**{k: x[k] for k in ("type", "zone", "time", "usd_per_hour")})
                               for x in hist]
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise FleetFileError(f"spot_history: {type(e).__name__}: {e}") from None
    return ff
