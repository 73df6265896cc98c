"""Result validation: decide whether a returned result may be merged.

A result's identity (job, unit) comes from the workunit it was uploaded for, as the
job system knows it (BOINC's workunit/result names, the local backend's record of what
a slot ran), never from inside the file: the caller passes what it expects
(:class:`Expected`: job, unit, model and the model's fingerprint, read from the job's
state by the assimilation framework), and a file whose embedded job, unit or model
disagrees is rejected with that reason. Nothing here reads Redis: the checks are pure
functions of the files and the expectation. Rejects (with one
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
from boinc_dl.server.common.errors import ResultRejected, WeightsFormatError
from boinc_dl.server.common.paths import check_name
from boinc_dl.server.common.weights import Fingerprint, WeightsFile, read_weights, upload_bound

MAX_METRICS_BYTES = 1 << 20
HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


@dataclass(frozen=True)
class Expected:
    """What a result must be, from the job system's names and the job's own records."""

    job: str
    unit: str
    model: str
    fingerprint: Fingerprint


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
        data = bounded.load_file(path, MAX_METRICS_BYTES, bounded.MAX_JSON_DEPTH)
    except (bounded.BoundExceeded, bounded.DuplicateKey) as e:
        raise ResultRejected(f"metrics file {path.name}: {e}") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ResultRejected(f"metrics file {path.name} is not JSON ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise ResultRejected(f"metrics file {path.name} is not a JSON object")
    return data


def validate_result(paths: Sequence[str | Path], expected: Expected, max_bytes: int | None) -> ValidResult:
    """Check a result of ``expected.unit`` (known from the job system) against it.

    ``max_bytes`` bounds each file (the spec's ``units.max_upload_bytes``); None derives
    it from the unit's model (:func:`~boinc_dl.server.common.weights.upload_bound`).
    Raises :class:`ResultRejected` with the reason.
    """
    check_name(expected.unit, "unit")
    max_bytes = upload_bound(expected.fingerprint, max_bytes)
    files = identify_files(paths)
    for p in (files.weights, files.metrics):
        if p is not None and p.stat().st_size > max_bytes:
            raise ResultRejected(f"{p.name} is {p.stat().st_size} bytes, over the {max_bytes}-byte bound")
    metrics = read_metrics(files.metrics)
    try:
        # Structure, sizes and the unit's fingerprint checked before any data is read.
        wf = read_weights(files.weights, expected.fingerprint, max_bytes)
    except WeightsFormatError as e:
        raise ResultRejected(str(e)) from None
    # What the file says it is must be what the job system issued it for.
    for got, want, why in (
        (wf.job, expected.job, f"result embeds job {wf.job[:80]!r}, but was uploaded for a unit of {expected.job!r}"),
        (wf.unit, expected.unit, f"result embeds unit {wf.unit[:80]!r}, but was uploaded for {expected.unit!r}"),
        (wf.model, expected.model, f"result is for model {wf.model[:40]!r}, unit trains model {expected.model!r}"),
    ):
        if got != want:
            raise ResultRejected(why)
    if wf.optimizer is not None:
        if not all(np.isfinite(a).all() for a in wf.optimizer.arrays if a.dtype.kind == "f"):
            raise ResultRejected("optimizer state contains NaN/Inf values")
    if not np.isfinite(wf.flat).all():
        bad = int(np.count_nonzero(~np.isfinite(wf.flat)))
        raise ResultRejected(f"weights contain {bad} NaN/Inf values")
    return ValidResult(files, wf, metrics)
