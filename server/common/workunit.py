"""The workunit contract: a JSON description plus input files under fixed logical names.

A client needs nothing but its input files (it never talks to Redis)::

    wu.json          this description
    model.keras      the model definition (sticky, one per job)
    weights_in.h5    server weights the unit starts from (one file per weights version)
    data.npz         the unit's data subset / partition, arrays x and y (sticky)
    val.npz          the validation split, arrays x and y (sticky)

and writes::

    weights_out.h5   trained weights (see :mod:`boinc_dl.server.common.weights`)
    metrics.json     train loss/accuracy, validation accuracy, examples seen, wall time

Physical file names (in the download hierarchy / the local backend's file store) are
unique per job and content so that BOINC can cache them as sticky files.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "boinc-dl-workunit"
FORMAT_VERSION = 1

# Logical (open) names inside a slot directory.
WU_JSON = "wu.json"
MODEL = "model.keras"
WEIGHTS_IN = "weights_in.h5"
DATA = "data.npz"
VAL = "val.npz"
WEIGHTS_OUT = "weights_out.h5"
METRICS = "metrics.json"
INPUT_NAMES = (WU_JSON, MODEL, WEIGHTS_IN, DATA, VAL)
OUTPUT_NAMES = (WEIGHTS_OUT, METRICS)


@dataclass
class Workunit:
    """Everything that identifies and parameterises one unit of training."""

    job: str
    unit: str
    mode: str  # "vcasgd" | "mop"
    epoch: int
    model: str
    shard: int  # data subset (VC-ASGD) or partition (MOP)
    weights_version: int
    training: dict[str, Any]
    seed: int
    hyper: dict[str, Any] = field(default_factory=dict)
    checkpoint_every_s: float = 10.0
    # The version of each shard of the server weights in the input weights file
    # (``weights_version`` is their minimum): the snapshot is atomic per shard only.
    weights_shard_versions: list[int] | None = None
    # physical names of the input files, keyed by logical name (not sent to clients)
    files: dict[str, str] = field(default_factory=dict)
    # hosts that cache this unit's data (MOP partitions); a hint for job systems that place
    # work themselves (the local backend); BOINC gets the same effect from sticky files and
    # locality scheduling. Not sent to clients.
    hosts: list[int] | None = None

    def to_json(self) -> str:
        d = asdict(self)
        d.pop("files")
        d.pop("hosts")
        return json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, **d}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Workunit:
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError("not a boinc-dl workunit description")
        d.pop("format")
        d.pop("format_version", None)
        return cls(**d)

    @classmethod
    def load(cls, path: str | Path) -> Workunit:
        return cls.from_json(Path(path).read_text())

    @property
    def wu_id(self) -> int:
        """A stable integer id (the local backend's stand-in for BOINC's workunit id)."""
        return zlib.crc32(self.unit.encode())


def unit_name(job: str, epoch: int, shard: int, model: str = "0", attempt: int = 0) -> str:
    """The canonical workunit name; ``attempt`` > 0 for a regenerated unit."""
    base = f"{job}__m{model}_e{epoch:04d}_s{shard:04d}"
    return base if attempt == 0 else f"{base}_r{attempt}"


def parse_unit_name(name: str) -> dict[str, Any] | None:
    """Inverse of :func:`unit_name`; None if ``name`` is not one of ours."""
    job, sep, rest = name.rpartition("__")
    if not sep or not job:
        return None
    parts = rest.split("_")
    try:
        d: dict[str, Any] = {"job": job, "model": parts[0][1:], "epoch": int(parts[1][1:]), "shard": int(parts[2][1:])}
        d["attempt"] = int(parts[3][1:]) if len(parts) > 3 else 0
    except (IndexError, ValueError):
        return None
    if not parts[0].startswith("m") or not parts[1].startswith("e") or not parts[2].startswith("s"):
        return None
    return d
