"""BOINC's result intake: what BOINC names a result, its files, and the one call into the framework.

Shared by the two BOINC transports of :mod:`boinc_dl.server.assimilator.framework`:
the script BOINC's ``script_assimilator`` runs (:mod:`.scripts`) and the docker
stack's spool consumer (:mod:`.spool`). A result's identity comes from BOINC's names
of its files (``<wu_name>_<n>_r<random>_<i>``) or BOINC's arguments, never from inside
the files; its files are copied (``<gzip_when_done/>`` uploads unpacked) within the
job's upload bound before anything reads them, since BOINC's file deleter removes the
originals once the assimilator returns.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.core import AssimilationOutcome
from boinc_dl.server.assimilator.framework import Delivery, assimilate
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.boinc.artifacts import job_upload_bound
from boinc_dl.server.backends.boinc.boincdb import (
    WU_ERROR_CANCELLED,
    WU_ERRORS,
    BoincDB,
    BoincDBError,
)
from boinc_dl.server.backends.boinc.hosttrust import cap_host_trust, demote_host
from boinc_dl.server.backends.boinc.project import BoincProject
from boinc_dl.server.backends.boinc.registry import BoincRegistry
from boinc_dl.server.common import bounded, diskfaults
from boinc_dl.server.common.errors import ResultRejected, StoreUnavailable
from boinc_dl.server.common.paths import confined, is_safe_name
from boinc_dl.server.common.procs import owned_prefix, sweep_orphaned_dirs
from boinc_dl.server.common.spec import JOB_NAME_RE, spec_from_json
from boinc_dl.server.common.workunit import parse_unit_name
from boinc_dl.server.validator.checks import identify_files

log = logging.getLogger("boinc-dl.intake")

OUT_FILE = re.compile(r"^(?P<result>.+)_r\d+_(?P<index>\d+)$")
GZIP_MAGIC = b"\x1f\x8b"


def result_name_of(path: str | Path) -> str:
    """The result name from an output file name (``<result>_r<random>_<i>``), else ''."""
    m = OUT_FILE.match(Path(path).name)
    return m.group("result") if m else ""


def wu_name_of_result(result: str) -> str:
    """The workunit name from a result name (``<wu>_<seq>``), else ''."""
    wu, sep, seq = result.rpartition("_")
    return wu if sep and seq.isdigit() else ""


def split_results(paths: Sequence[str]) -> list[list[str]]:
    """Group output files by result (order of appearance); halves if names are foreign."""
    groups: dict[str, list[str]] = {}
    for p in paths:
        name = result_name_of(p)
        if not name:
            half = len(paths) // 2
            return [list(paths[:half]), list(paths[half:])]
        groups.setdefault(name, []).append(p)
    return list(groups.values())


def describe_mask(mask: int) -> str:
    """Human-readable reasons of a workunit error mask."""
    parts = [text for bit, text in WU_ERRORS.items() if mask & bit]
    return f"BOINC gave up on the workunit: {', '.join(parts) or 'unknown reason'} (error mask {mask})"




class TransientFault(Exception):
    """Retry later (Redis down, upload directory missing)."""


def check_files(paths: Sequence[str]) -> list[str]:
    """Missing files (raises :class:`TransientFault` when their directory is missing:
    BOINC's validator treats a missing directory as a transient NFS problem)."""
    missing = []
    for p in map(Path, paths):
        if not p.is_file():
            if not p.parent.is_dir():
                raise TransientFault(f"directory {p.parent} of result file {p.name} is missing")
            missing.append(str(p))
    return missing


def copy_result(paths: Sequence[str], dest: Path, max_bytes: int) -> list[Path]:
    """Copy result files into ``dest`` (gunzipping ``<gzip_when_done/>`` uploads).

    Each file is bounded by ``max_bytes`` (the job's upload bound): a gzip'd one is
    decompressed as a stream that stops there (a gzip bomb costs ``max_bytes`` of disk,
    not gigabytes). Symbolic links are refused (the server reads only upload files).
    """
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for p in map(Path, paths):
        try:
            if p.is_symlink():
                raise ResultRejected(f"result file {p.name} is a symbolic link")
            target = confined(dest, p.name)
            with p.open("rb") as f:
                gz = f.read(2) == GZIP_MAGIC
            if gz:
                bounded.gunzip_bounded(p, target, max_bytes)
            else:
                bounded.copy_file_bounded(p, target, max_bytes)
        except bounded.BoundExceeded as e:
            raise ResultRejected(f"result file {p.name}: {e} (the upload bound)") from None
        except (OSError, EOFError) as e:
            fault = diskfaults.as_server_error(e, dest, then="BOINC hands the result over again later")
            if fault is not None:  # the server's disk, not the upload: retry later, charge nothing
                raise fault from None
            raise ResultRejected(f"result file {p.name} cannot be read: {e}") from None
        out.append(target)
    return out


def store_for(project: BoincProject, job: str, wait_s: float = 0.0) -> JobStore:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return JobStore(connect(project.redis_url(), timeout=5.0), job)
        except StoreUnavailable:
            if time.monotonic() >= deadline:
                raise
            time.sleep(1.0)


def identity_from_names(paths: Sequence[str | Path], wu_name: str | None = None) -> tuple[str, str]:
    """(job, workunit name) of a result, from what BOINC names: the output files'
    names (``<wu>_<n>_r<random>_<i>``, checked to agree) or the ``wu_name`` argument;
    ("", "") when BOINC names no boinc-dl workunit. Never from inside the files."""
    names = {wu_name_of_result(result_name_of(p)) for p in paths}
    wu = names.pop() if len(names) == 1 else ""
    if not wu and not names:
        wu = wu_name or ""
    if wu_name and wu and wu_name != wu:
        return "", ""
    parsed = parse_unit_name(wu) if is_safe_name(wu) else None
    if not parsed or not JOB_NAME_RE.match(parsed["job"]):
        return "", ""
    return parsed["job"], wu


def assimilate_upload(project: BoincProject, store: JobStore, wu: str, result: str,
                      paths: Sequence[str | Path], missing: Sequence[str] | None = None) -> AssimilationOutcome:
    """Assimilate BOINC's canonical result ``result`` of workunit ``wu`` (files ``paths``;
    ``missing``: the ones BOINC named that are gone, found here when not given): the
    framework's path, with BOINC's records and file intake."""
    if missing is None:
        missing = check_files([str(p) for p in paths])
    paths = [p for p in paths if str(p) not in set(missing)]
    spool = project.boincdl_dir / "spool"
    sweep_orphaned_dirs(spool)
    work = Path(tempfile.mkdtemp(prefix=owned_prefix(result if is_safe_name(result) else "result"), dir=spool))
    copies: list[Path] = []
    spec_holder: dict[str, object] = {}

    def files() -> list[Path]:
        spec = spec_from_json(store.spec_json())
        spec_holder["spec"] = spec
        copies.extend(copy_result(paths, work, job_upload_bound(store, spec)))
        return copies

    trusted, host = result_standing(project, wu, result)
    try:
        out = assimilate(store, Delivery(wu, result, files=files, missing=missing, final=True,
                                         trusted=trusted, host=host),
                         BoincRegistry(store))
        if copies and out.unit and out.status in ("merged", "duplicate"):
            try:
                keep_result(project, store, out.unit, copies, weights=project.settings.keep_weights)
            except OSError as e:  # merged already: a copy the server cannot write is not the host's fault
                log.warning("result %s merged, its files not kept: %s", result, e)
        if out.status == "rejected" and out.host_fault and result:
            # BOINC's validator called the result valid; the refusal must cost the host
            # the trust an invalid result would have (BOINC's adaptive replication).
            demote_host(project, store, result, out.reason)
        elif out.status == "merged" and out.judged_stale and result:
            # the loss check lacked comparable trusted results: more spot checks make them
            cap_host_trust(project, result)
        return out
    finally:
        # The working copies go; a durable merge has already given the weights copy a
        # second name in the job's retained area (a hard link, same filesystem as the
        # spool when the job dir is under the project; else a copy), which its merge
        # log names until a snapshot covers it (server/assimilator/retained.py).
        shutil.rmtree(work, ignore_errors=True)


#: ``result.validate_state`` of a result the validator found valid (db/boinc_db_types.h).
VALIDATE_STATE_VALID = 1


def result_standing(project: BoincProject, wu: str, result: str) -> tuple[bool, str | None]:
    """What BOINC's database says of result ``result`` of workunit ``wu``: whether it
    agreed with a replica from another host (BOINC's quorum: only such results may feed
    the statistics that bound updates; a patient host cannot vouch for itself), and the
    id of the host that computed it (``result.hostid``: its loss ledger), both from
    BOINC's records, never from the result's files. (False, None) when BOINC's database
    cannot be read or does not know the workunit."""
    try:
        with BoincDB.connect(project) as db:
            state = db.workunits([wu]).get(wu)
    except BoincDBError:
        return False, None
    if state is None:
        return False, None
    hosts = {r.hostid for r in state.results if r.validate_state == VALIDATE_STATE_VALID and r.hostid}
    mine = [r.hostid for r in state.results if r.name == result and r.hostid]
    return len(hosts) >= 2, (str(mine[0]) if mine else None)


def assimilate_give_up(store: JobStore, wu: str, mask: int) -> AssimilationOutcome:
    """BOINC gave up on workunit ``wu`` (``--error`` with ``mask``). A workunit the work
    generator cancelled as stuck says so: the unit is given up as any failed one (a MOP
    sub-epoch runs again as a new workunit), and ``boinc-dl status`` shows why. A
    cancelled workunit still in the live records is counted as cancelled here (once:
    :meth:`BoincRegistry.cancelled`)."""
    reg = BoincRegistry(store)
    error = describe_mask(mask)
    if mask & WU_ERROR_CANCELLED:
        # counted here if the work generator was killed before it recorded its cancel
        reg.cancelled(wu)
    if mask & WU_ERROR_CANCELLED and reg.was_stuck(wu):
        error = ("cancelled as stuck: results came back, and no host that had not had one could take "
                 "the replica BOINC needed; the sub-epoch runs again as a new workunit")
    return assimilate(store, Delivery(wu, error=error, final=True), reg)


def keep_result(project: BoincProject, store: JobStore, unit: str, copies: Sequence[Path],
                weights: bool = True) -> None:
    """Keep a merged result's metrics (and, with ``keep_weights``, its weights) under the
    job's results directory, ``jobs/<job>/results/<unit>/``: nowhere else, so they go
    with the job's directory. ``unit`` comes from BOINC's names and the job's own
    records, and the directory is still built through :func:`confined`: nothing a host
    wrote picks a path. Kept weights are bounded (each by the upload bound, all of a
    job's by ``keep_weights_max_bytes``) and counted (``kept_weights``,
    ``kept_weights_bytes``, ``kept_weights_refused`` in the job's counters)."""
    if not unit or not copies or not is_safe_name(unit):
        return
    job_dir = store.meta().get("job_dir") or str(project.job_dir(store.job))
    results = Path(job_dir) / "results"
    results.mkdir(parents=True, exist_ok=True)
    dest = confined(results, unit)
    dest.mkdir(exist_ok=True)
    try:
        files = identify_files(copies)
    except ResultRejected:
        return
    if files.metrics is not None:
        _place(files.metrics, dest / "metrics.json")
    if weights:
        _keep_weights(project, store, files.weights, dest / "weights_out.h5")


def _place(src: Path, target: Path) -> None:
    """Copy ``src`` to ``target`` whole or not at all (a temporary name, then a rename)."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _keep_weights(project: BoincProject, store: JobStore, src: Path, target: Path) -> None:
    if target.exists():
        return  # kept (and counted) by an earlier run of this assimilation
    size = src.stat().st_size
    cap = project.settings.keep_weights_max_bytes
    # Reserve the bytes first: two assimilators never both take the last room.
    store.incr_counter("kept_weights_bytes", size)
    if store.counters().get("kept_weights_bytes", 0) > cap:
        store.incr_counter("kept_weights_bytes", -size)
        store.incr_counter("kept_weights_refused")
        log.warning("weights of unit %s not kept: the job's kept weights would exceed keep_weights_max_bytes (%d)",
                    target.parent.name, cap)
        return
    try:
        _place(src, target)
    except OSError:
        store.incr_counter("kept_weights_bytes", -size)
        raise
    store.incr_counter("kept_weights")
