"""Result validation: decide whether a returned result may be merged.

A result's identity (job, unit) comes from the workunit it was uploaded for, as the
job system knows it (BOINC's workunit/result names, the local backend's record of what
a slot ran), never from inside the file: the caller passes the unit, and a file whose
embedded job, unit or model disagrees is rejected with that reason. Rejects (with one
clear reason each) a result whose files are missing or oversized, whose weights file
is not exactly what ``write_weights`` writes (see :mod:`boinc_dl.server.common.weights`: no
links, external storage, virtual datasets or filters, shapes and sizes checked before
any read), whose tensors do not match the unit's model fingerprint, that contains
NaN/Inf, or whose metrics file is not a bounded JSON object. The same function serves
BOINC's ``script_validator`` and the local backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from boinc_dl.server.common import bounded
from boinc_dl.server.common.errors import ResultRejected, UnknownJob, WeightsFormatError
from boinc_dl.server.common.paths import check_name, is_safe_name
from boinc_dl.server.common.store import JobStore
from boinc_dl.server.common.weights import WeightsFile, read_weights
from boinc_dl.server.common.workunit import parse_unit_name, unit_name

MAX_METRICS_BYTES = 1 << 20
MAX_METRICS_DEPTH = 16
HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


@dataclass
class ResultFiles:
    """The two output files of a result, whatever their physical names."""

    weights: Path
    metrics: Path | None


@dataclass
class ValidResult:
    """A result that passed validation, with its decoded contents."""

    files: ResultFiles
    weights: WeightsFile
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def unit(self) -> str:
        """The unit (checked equal to the one the job system issued the result for)."""
        return self.weights.unit

    @property
    def job(self) -> str:
        return self.weights.job


def identify_files(paths: Sequence[str | Path]) -> ResultFiles:
    """Find the weights (HDF5 signature) and metrics (JSON) among a result's files."""
    weights: Path | None = None
    metrics: Path | None = None
    for p in map(Path, paths):
        if p.is_symlink():
            # The server reads only what the host uploaded, never what a link points at.
            raise ResultRejected(f"result file {p.name} is a symbolic link")
        try:
            with p.open("rb") as f:
                head = f.read(8)
        except OSError:
            raise ResultRejected(f"result file {p.name} is missing or unreadable") from None
        if head == HDF5_MAGIC or (p.name.endswith(".h5") and weights is None):
            weights = p
        elif metrics is None:
            metrics = p
    if weights is None:
        raise ResultRejected("no HDF5 weights file among the result's files")
    return ResultFiles(weights, metrics)


def read_metrics(path: Path | None) -> dict[str, Any]:
    """Decode the metrics file (bounded in size and nesting); a missing one is empty,
    a malformed one is rejected."""
    if path is None:
        return {}
    try:
        data = bounded.load_file(path, MAX_METRICS_BYTES, MAX_METRICS_DEPTH)
    except bounded.BoundExceeded as e:
        raise ResultRejected(f"metrics file {path.name}: {e}") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ResultRejected(f"metrics file {path.name} is not JSON ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise ResultRejected(f"metrics file {path.name} is not a JSON object")
    return data


def unit_for_workunit(store: JobStore, wu_name: str) -> str | None:
    """The unit a workunit name stands for: itself when registered (MOP's attempts are
    units of their own), else the unit it regenerates (``<unit>_r<n>``); None if neither."""
    if not is_safe_name(wu_name):
        return None
    if store.unit_info(wu_name) is not None:
        return wu_name
    p = parse_unit_name(wu_name)
    if p and p["attempt"] and p["job"] == store.job:
        base = unit_name(p["job"], p["epoch"], p["shard"], p["model"])
        if store.unit_info(base) is not None:
            return base
    return None


def validate_result(
    paths: Sequence[str | Path],
    store: JobStore,
    max_bytes: int,
    expected_unit: str,
) -> ValidResult:
    """Check a result of ``expected_unit`` (known from the job system) against its job.

    Raises :class:`ResultRejected` with the reason, or
    :class:`~boinc_dl.server.common.errors.StoreUnavailable` (a transient fault, not a verdict)
    when Redis cannot be reached.
    """
    check_name(expected_unit, "unit")
    files = identify_files(paths)
    for p in (files.weights, files.metrics):
        if p is not None and p.stat().st_size > max_bytes:
            raise ResultRejected(f"{p.name} is {p.stat().st_size} bytes, over the {max_bytes}-byte bound")
    metrics = read_metrics(files.metrics)
    try:
        store.require()
    except UnknownJob as e:
        raise ResultRejected(str(e)) from None
    info = store.unit_info(expected_unit)
    if info is None:
        raise ResultRejected(f"unknown unit {expected_unit!r} for job {store.job!r}")
    model = str(info.get("model", "0"))
    try:
        expected = store.fingerprint(model)
    except UnknownJob as e:
        raise ResultRejected(str(e)) from None
    try:
        # Structure, sizes and the unit's fingerprint checked before any data is read.
        wf = read_weights(files.weights, expected, max_bytes)
    except WeightsFormatError as e:
        raise ResultRejected(str(e)) from None
    if wf.job != store.job:
        raise ResultRejected(f"result embeds job {wf.job[:80]!r}, but was uploaded for a unit of {store.job!r}")
    if wf.unit != expected_unit:
        raise ResultRejected(f"result embeds unit {wf.unit[:80]!r}, but was uploaded for {expected_unit!r}")
    if wf.model != model:
        raise ResultRejected(f"result is for model {wf.model[:40]!r}, unit trains model {model!r}")
    if wf.optimizer is not None:
        if not all(np.isfinite(a).all() for a in wf.optimizer.arrays if a.dtype.kind == "f"):
            raise ResultRejected("optimizer state contains NaN/Inf values")
    if not np.isfinite(wf.flat).all():
        bad = int(np.count_nonzero(~np.isfinite(wf.flat)))
        raise ResultRejected(f"weights contain {bad} NaN/Inf values")
    return ValidResult(files, wf, metrics)
