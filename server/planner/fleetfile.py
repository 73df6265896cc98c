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
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from server.planner.model import HostType, ServerCosts
from server.planner.prices import MARKETS


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

    def host_types(self, calibrated_unit_s: float | None) -> tuple[list[HostType], list[int]]:
        """The HostTypes and their max counts; ``speed`` entries need a calibrated unit time."""
        hosts, counts = [], []
        for name, row in self.types.items():
            if "unit_s" in row:
                unit_s = float(row["unit_s"])
            elif calibrated_unit_s is not None:
                unit_s = calibrated_unit_s / float(row.get("speed", 1.0))
            else:
                raise FleetFileError(f"types.{name}: give unit_s, or calibrate (--calibrate or --history)")
            hosts.append(HostType(name, unit_s, int(row.get("cores", 4)), float(row.get("bandwidth_mbps", 1000.0)),
                                  float(row.get("preempt_p", 0.05))))
            counts.append(int(row.get("max_count", 4)))
        return hosts, counts

    def server_costs(self, model_bytes: int, merge_s: float | None = None) -> ServerCosts:
        """Server-side costs: the file's, else a calibrated merge time, else an estimate
        from the model size (Redis read + write and an HDF5 read at ~250 MB/s each)."""
        c = self.costs
        m = float(c["merge_s"]) if "merge_s" in c else merge_s if merge_s is not None else \
            0.01 + 3 * model_bytes / 250e6
        speed = {int(k): float(v) for k, v in (c.get("speedup") or {}).items()}
        speed.setdefault(1, 1.0)
        return ServerCosts(m, speed, float(c.get("stage_s", 0.02 + 2 * model_bytes / 500e6)),
                           float(c.get("dispatch_s", 0.05)), int(c.get("server_cores", 2)))


def _ints(raw: Any, key: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not raw or not all(isinstance(x, int) and 0 < x <= 1024 for x in raw):
        raise FleetFileError(f"{key}: a non-empty list of positive integers expected")
    return tuple(raw)


def load_fleet(path: Path | str) -> FleetFile:
    """Read and check a fleet.yaml."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise FleetFileError(f"{p}: {e}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("types"), dict) or not raw["types"]:
        raise FleetFileError(f"{p}: 'types' must map instance types to their settings")
    for name, row in raw["types"].items():
        if not isinstance(row, dict):
            raise FleetFileError(f"types.{name}: a mapping expected")
        for k in ("unit_s", "speed", "bandwidth_mbps"):
            if k in row and not (isinstance(row[k], (int, float)) and row[k] > 0):
                raise FleetFileError(f"types.{name}.{k}: a positive number expected")
        if not 0 <= float(row.get("preempt_p", 0)) < 1:
            raise FleetFileError(f"types.{name}.preempt_p: in [0, 1)")
        if not 1 <= int(row.get("max_count", 4)) <= 64:
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
    ff.costs = dict(raw.get("costs") or {})
    if "params" in raw:
        if not isinstance(raw["params"], int) or raw["params"] <= 0:
            raise FleetFileError("params: a positive integer expected")
        ff.params = raw["params"]
    if raw.get("spot_history"):
        hist = json.loads((p.parent / str(raw["spot_history"])).read_text())
        ff.spot_history = [SimpleNamespace(**{k: x[k] for k in ("type", "zone", "time", "usd_per_hour")})
                           for x in hist]
    return ff
