"""Result helpers for tests: hand files to the one assimilation path as a job system would.

Tests exercise the framework (:mod:`boinc_dl.server.assimilator.framework`) itself;
these helpers only spell a job system's call compactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from boinc_dl.server.assimilator.core import AssimilationOutcome
from boinc_dl.server.assimilator.framework import Delivery, assimilate, expected_of
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.boinc.intake import wu_name_of_result
from boinc_dl.server.common.spec import JobSpec
from boinc_dl.server.validator.checks import ValidResult, validate_result


def assimilate_files(store: JobStore, paths: Sequence[str | Path], spec: JobSpec | None = None,
                     result_name: str = "", unit: str | None = None, final: bool = False) -> AssimilationOutcome:
    """Deliver a result's files for ``unit`` (else the workunit that BOINC's result name
    ``<workunit>_<n>`` names); ``final`` as BOINC's assimilator (a rejection gives up)."""
    wu = unit or wu_name_of_result(result_name) or result_name
    return assimilate(store, Delivery(wu, result_name, unit=unit, files=[Path(p) for p in paths], final=final),
                      spec=spec)


def assimilate_error(store: JobStore, unit: str, reason: str) -> AssimilationOutcome:
    """The job system gave up on ``unit`` for good."""
    return assimilate(store, Delivery(unit, unit=unit, error=reason))


def validate(paths: Sequence[str | Path], store: JobStore, max_bytes: int, unit: str) -> ValidResult:
    """Validate a result of ``unit`` against what the job expects of it."""
    return validate_result(paths, expected_of(store, unit), max_bytes)


def finish_retained(under: Path) -> None:
    """Let the hashing threads of the inputs retained under ``under`` (a test's own
    directory) finish and record their SHA-256, as a process's exit does for all of them
    (``retained._finish_pending``); threads another test left behind, whose Redis may be
    gone, are not waited for."""
    from boinc_dl.server.assimilator import retained

    under = Path(under).resolve()
    for inp in list(retained._inputs):
        if under in Path(inp.path).resolve().parents:
            inp._go.set()
            inp._handed.set()
            inp._thread.join(60)
