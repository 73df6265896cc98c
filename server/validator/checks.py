"""Result validation: decide whether a returned result may be merged.

Rejects (with one clear reason each) a result whose files are missing or oversized,
whose weights file is not readable HDF5 or is truncated, whose tensors do not match
the model fingerprint (names, shapes, dtypes), that contains NaN/Inf, whose metrics
file is not a JSON object, or that names an unknown job or unit. The same function
serves BOINC's ``script_validator`` and the local backend.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from server.common.errors import ResultRejected, UnknownJob, WeightsFormatError
from server.common.store import JobStore
from server.common.weights import WeightsFile, check_fingerprint, read_header, read_weights

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
        return self.weights.unit

    @property
    def job(self) -> str:
        return self.weights.job


def identify_files(paths: Sequence[str | Path]) -> ResultFiles:
    """Find the weights (HDF5 signature) and metrics (JSON) among a result's files."""
    weights: Path | None = None
    metrics: Path | None = None
    for p in map(Path, paths):
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
    """Decode the metrics file; a missing one is empty, a malformed one is rejected."""
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ResultRejected(f"metrics file {path.name} is not JSON ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise ResultRejected(f"metrics file {path.name} is not a JSON object")
    return data


def peek_identity(paths: Sequence[str | Path]) -> tuple[str, str]:
    """(job, unit) written by the client into the result, without full validation."""
    files = identify_files(paths)
    try:
        h = read_header(files.weights)
        if h.job and h.unit:
            return h.job, h.unit
    except WeightsFormatError:
        pass
    m = read_metrics(files.metrics)
    job, unit = m.get("job"), m.get("unit")
    if isinstance(job, str) and isinstance(unit, str) and job and unit:
        return job, unit
    raise ResultRejected("the result names no job/unit (weights header and metrics both unreadable)")


def validate_result(
    paths: Sequence[str | Path],
    store: JobStore,
    max_bytes: int,
    expected_unit: str | None = None,
) -> ValidResult:
    """Check a result against its job; raises :class:`ResultRejected` with the reason.

    Raises :class:`~server.common.errors.StoreUnavailable` (a transient fault, not a
    verdict) when Redis cannot be reached.
    """
    files = identify_files(paths)
    for p in (files.weights, files.metrics):
        if p is not None and p.stat().st_size > max_bytes:
            raise ResultRejected(f"{p.name} is {p.stat().st_size} bytes, over the {max_bytes}-byte bound")
    metrics = read_metrics(files.metrics)
    try:
        store.require()
    except UnknownJob as e:
        raise ResultRejected(str(e)) from None
    try:
        # One read: header and tensors (checked against the file's own fingerprint).
        wf = read_weights(files.weights)
    except WeightsFormatError as e:
        raise ResultRejected(str(e)) from None
    if wf.job != store.job:
        raise ResultRejected(f"result belongs to job {wf.job!r}, not {store.job!r}")
    if expected_unit is not None and wf.unit != expected_unit:
        raise ResultRejected(f"result is for unit {wf.unit!r}, expected {expected_unit!r}")
    info = store.unit_info(wf.unit)
    if info is None:
        raise ResultRejected(f"unknown unit {wf.unit!r} for job {store.job!r}")
    model = str(info.get("model", "0"))
    if wf.model != model:
        raise ResultRejected(f"result is for model {wf.model!r}, unit trains model {model!r}")
    try:
        check_fingerprint(wf.fingerprint, store.fingerprint(model))
    except (WeightsFormatError, UnknownJob) as e:
        raise ResultRejected(f"{files.weights.name}: {e}") from None
    if wf.optimizer is not None:
        size = sum(a.size for a in wf.optimizer.arrays)
        if size > 4 * wf.flat.size + 16:
            raise ResultRejected(f"optimizer state has {size} values for a model of {wf.flat.size}")
        if not all(np.isfinite(a).all() for a in wf.optimizer.arrays if a.dtype.kind == "f"):
            raise ResultRejected("optimizer state contains NaN/Inf values")
    if not np.isfinite(wf.flat).all():
        bad = int(np.count_nonzero(~np.isfinite(wf.flat)))
        raise ResultRejected(f"weights contain {bad} NaN/Inf values")
    return ValidResult(files, wf, metrics)
