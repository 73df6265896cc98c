"""Shared helpers for the benchmarks: one machine-readable line per result."""

from __future__ import annotations

import json
import platform
import statistics
import sys
from typing import Any


def emit(name: str, **fields: Any) -> None:
    """Print ``BENCH {json}``: the line CI logs and bench/README.md quote."""
    print("BENCH " + json.dumps({"name": name, **fields}, default=float), flush=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def machine() -> dict[str, Any]:
    import os

    return {"python": sys.version.split()[0], "cpus": os.cpu_count(), "machine": platform.machine()}
