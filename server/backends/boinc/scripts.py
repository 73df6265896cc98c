"""The programs BOINC's ``script_validator`` and ``script_assimilator`` daemons call.

How the daemons call them (``sched/script_assimilator.cpp``, ``sched/script_validator.cpp``,
``sched/validate_util2.cpp``, ``lib/str_util.cpp``), all through ``system()`` from
``tmp_<host>`` as ``../bin/<script> args``:

* the script string is split on spaces; on releases 1.6.x ``split()`` keeps the
  delimiter on every piece, so a multi-token string (``"x wu_name files"``) matches no
  token and the script gets **no arguments**. A single token (``"x"``) gets the
  defaults: ``wu_id files`` (assimilator), ``files`` (init script), ``files files2``
  (compare script). We declare single tokens and take the unit's identity from the
  output file names (``<wu_name>_<n>_r<random>_<i>``, named by BOINC, never from inside
  the files, which the host wrote); other token sets (``files files2 wu_id wu_name result_id runtime
  batch_id``) are parsed too, for servers where they work.
* a workunit without canonical result: ``--error <mask> <wu_name> <wu_id> <batch>``
  (1.6 and later) or ``--error <mask> <wu_id>`` (1.2).
* assimilator: any non-zero exit makes the daemon exit (the workunit stays
  ``ASSIMILATE_READY`` and is handed over again when the daemon is restarted), so the
  script exits 0 for every handled outcome (merged, duplicate, rejected, failed —
  recorded in Redis) and non-zero only for transient faults (Redis down, upload
  directory missing).
* validator: 0 = valid, 3 (``VAL_RESULT_TRANSIENT_ERROR``) = try again later, anything
  else = invalid (the transitioner then issues another instance). Release 1.2 knows no
  transient code (any non-zero is invalid), so the validator first waits a while for
  Redis before giving up.
* output files are ``upload/<hash>/<result>_r<random>_<i>``; the file deleter removes
  them right after assimilation, so the assimilator copies what it keeps first.

Kept as one module (about 600 lines): BOINC's argument forms, the validator and the
assimilator share one parser and one set of exit-code rules, and read best together.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from boinc_dl.server.backends.boinc.jobsystem import UNIT_DONE, forget_workunit, issued_key
from boinc_dl.server.backends.boinc.project import BoincProject
from boinc_dl.server.common import bounded
from boinc_dl.server.common.errors import (
    ResultRejected,
    StoreUnavailable,
    UnknownJob,
    WeightsFormatError,
)
from boinc_dl.server.common.paths import confined, is_safe_name
from boinc_dl.server.common.spec import JOB_NAME_RE
from boinc_dl.server.common.store import PREFIX, JobStore, connect
from boinc_dl.server.common.weights import read_weights
from boinc_dl.server.common.workunit import OUTPUT_NAMES, WEIGHTS_IN, parse_unit_name, unit_name

log = logging.getLogger("boinc-dl.scripts")

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_CONFIG = 2
EXIT_TRANSIENT = 3  # VAL_RESULT_TRANSIENT_ERROR (sched/validate_util2.h)

# WU_ERROR_* (db/boinc_db_types.h)
WU_ERRORS = {
    1: "couldn't send a result",
    2: "too many error results",
    4: "too many success results without consensus",
    8: "too many total results",
    16: "cancelled",
    32: "no canonical result",
}
WU_ERROR_CANCELLED = 16

OUT_FILE = re.compile(r"^(?P<result>.+)_r\d+_(?P<index>\d+)$")
GZIP_MAGIC = b"\x1f\x8b"
UNRESOLVED_KEY = f"{PREFIX}:boinc:unresolved_errors"
TOKENS = ("files", "files2", "wu_id", "wu_name", "result_id", "runtime", "batch_id",
          "result_id2", "runtime2")


# ---- argument forms -----------------------------------------------------------------------

@dataclass
class ScriptCall:
    """What a BOINC daemon passed to a script, whatever the token set."""

    files: list[str] = field(default_factory=list)
    files2: list[str] = field(default_factory=list)
    logical: dict[str, str] = field(default_factory=dict)
    wu_id: int | None = None
    wu_name: str | None = None
    result_id: int | None = None
    runtime: float | None = None
    batch_id: int | None = None
    error_mask: int | None = None
    extra: list[str] = field(default_factory=list)


def _is_int(s: str) -> bool:
    return bool(re.fullmatch(r"-?\d+", s))


def _is_float(s: str) -> bool:
    return bool(re.fullmatch(r"-?\d+\.\d*(e[-+]?\d+)?", s, re.I))


def _is_path(s: str) -> bool:
    return "/" in s


def parse_error_call(argv: Sequence[str]) -> ScriptCall:
    """``--error <mask> <wu_name> <wu_id> <batch>`` (1.6+) or ``--error <mask> <wu_id>`` (1.2)."""
    rest = list(argv[1:])
    if not rest or not _is_int(rest[0]):
        raise ValueError(f"--error needs an integer error mask, got {rest[:1]}")
    call = ScriptCall(error_mask=int(rest[0]))
    args = rest[1:]
    if len(args) == 1 and _is_int(args[0]):
        call.wu_id = int(args[0])
    elif len(args) == 3 and _is_int(args[1]) and _is_int(args[2]):
        call.wu_name, call.wu_id, call.batch_id = args[0], int(args[1]), int(args[2])
    elif len(args) >= 1 and not _is_int(args[0]):
        call.wu_name = args[0]
        call.extra = args[1:]
    else:
        raise ValueError(f"unrecognised --error arguments {args}")
    return call


def parse_declared(argv: Sequence[str], tokens: Sequence[str], n_outputs: int = len(OUTPUT_NAMES)) -> ScriptCall:
    """Parse ``argv`` given the declared token list (e.g. ``["wu_name", "files"]``).

    ``files`` takes ``n_outputs`` paths (all remaining ones when it is the last
    token), ``files2`` twice as many (path, logical name pairs).
    """
    call = ScriptCall()
    args = list(argv)
    i = 0
    for k, tok in enumerate(tokens):
        last = k == len(tokens) - 1
        if tok not in TOKENS:
            raise ValueError(f"unknown token {tok!r}; known: {', '.join(TOKENS)}")
        if tok in ("files", "files2"):
            width = 2 if tok == "files2" else 1
            n = len(args) - i if last else n_outputs * width
            chunk = args[i : i + n]
            i += n
            if tok == "files":
                call.files.extend(chunk)
            else:
                for p, name in zip(chunk[::2], chunk[1::2], strict=False):
                    call.files.append(p)
                    call.logical[p] = name
            continue
        if i >= len(args):
            raise ValueError(f"missing value for token {tok!r}")
        val = args[i]
        i += 1
        try:
            if tok == "wu_id":
                call.wu_id = int(val)
            elif tok == "wu_name":
                call.wu_name = val
            elif tok in ("result_id", "result_id2"):
                call.result_id = call.result_id if tok == "result_id2" else int(val)
            elif tok in ("runtime", "runtime2"):
                call.runtime = call.runtime if tok == "runtime2" else float(val)
            elif tok == "batch_id":
                call.batch_id = int(val)
        except ValueError:
            raise ValueError(f"token {tok!r}: {val!r} is not a number") from None
    call.extra = args[i:]
    return call


def parse_guess(argv: Sequence[str]) -> ScriptCall:
    """Parse ``argv`` without knowing the declared tokens.

    Paths contain ``/`` (BOINC passes absolute upload paths); a path followed by one
    of our logical output names is a ``files2`` pair; a decimal number is the runtime;
    a bare word is the workunit name; integers are, in order, wu_id, result_id and
    batch_id (only the single-token default ``wu_id files`` is unambiguous; the unit's
    identity is read from the files anyway).
    """
    call = ScriptCall()
    ints: list[int] = []
    i = 0
    args = list(argv)
    while i < len(args):
        a = args[i]
        if _is_path(a):
            call.files.append(a)
            if i + 1 < len(args) and args[i + 1] in OUTPUT_NAMES:
                call.logical[a] = args[i + 1]
                i += 1
        elif _is_int(a):
            ints.append(int(a))
        elif _is_float(a):
            call.runtime = float(a)
        elif call.wu_name is None:
            call.wu_name = a
        else:
            call.extra.append(a)
        i += 1
    for name, v in zip(("wu_id", "result_id", "batch_id"), ints, strict=False):
        setattr(call, name, v)
    return call


def parse_call(argv: Sequence[str], tokens: Sequence[str] | None = None) -> ScriptCall:
    """Any argument form of the assimilator/validator scripts (see module docstring)."""
    if argv and argv[0] == "--error":
        return parse_error_call(argv)
    if tokens:
        return parse_declared(argv, tokens)
    return parse_guess(argv)


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


# ---- files --------------------------------------------------------------------------------

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
            raise ResultRejected(f"result file {p.name} cannot be read: {e}") from None
        out.append(target)
    return out


def _store_for(project: BoincProject, job: str, wait_s: float = 0.0) -> JobStore:
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


def _identity(call: ScriptCall, paths: Sequence[str]) -> tuple[str, str]:
    return identity_from_names(paths, call.wu_name)


# ---- superseded workunits -----------------------------------------------------------------

def superseded_by(store: JobStore, wu: str) -> str | None:
    """The workunit that replaced ``wu``, if boinc-dl regenerated its unit; else None.

    ``wu`` is a BOINC workunit name (from BOINC's arguments or its result file names,
    never from inside a file). A MOP unit re-run under ``<unit>_r<n>`` is a unit of its
    own (its record is its own); a VC-ASGD unit regenerated by re-issue policy
    ``fresh`` keeps its name and runs as ``<unit>_r<n>``.
    """
    parsed = parse_unit_name(wu)
    if not parsed:
        return None
    for unit in (wu, unit_name(parsed["job"], parsed["epoch"], parsed["shard"], parsed["model"])):
        raw = store.r.hget(issued_key(store), unit)
        if raw:
            current = str(json.loads(raw)["name"])
            return None if current == wu else current
    return None


def _late_call(store: JobStore, wu: str, what: str) -> bool:
    """A call about a superseded workunit: logged and counted, nothing else (True)."""
    current = superseded_by(store, wu)
    if current is None:
        return False
    log.info("%s: %s of a superseded workunit (its unit now runs as %s); nothing recorded", wu, what, current)
    forget_workunit(store.r, store.job, wu)
    store.r.hincrby(store.k("counters"), "boinc_superseded_calls", 1)
    return True


# ---- assimilator --------------------------------------------------------------------------

def assimilate(project: BoincProject, argv: Sequence[str], tokens: Sequence[str] | None = None) -> int:
    """``script_assimilator``'s script: merge a canonical result, or record a failure."""
    try:
        call = parse_call(argv, tokens)
    except ValueError as e:
        log.error("cannot parse the arguments %s: %s", list(argv), e)
        return EXIT_CONFIG
    try:
        if call.error_mask is not None:
            return _assimilate_error(project, call)
        if not call.files:
            log.error("called without result files (argv %s). On 1.6.x servers declare the daemon "
                      "with a single token: --script bdl_assimilate", list(argv))
            return EXIT_CONFIG
        return _assimilate_result(project, call)
    except (StoreUnavailable, TransientFault) as e:
        log.error("transient fault, BOINC will hand this workunit over again: %s", e)
        return EXIT_TRANSIENT


def _assimilate_result(project: BoincProject, call: ScriptCall) -> int:
    from boinc_dl.server.assimilator.core import (
        AssimilationOutcome,
        assimilate_error,
        assimilate_files,
    )
    from boinc_dl.server.common.spec import spec_from_json
    from boinc_dl.server.validator.checks import unit_for_workunit

    result = result_name_of(call.files[0])
    missing = check_files(call.files)
    job, wu = _identity(call, call.files)
    if not job:
        log.error("result %s: BOINC names no boinc-dl workunit (files %s); nothing recorded",
                  result or "?", [Path(f).name for f in call.files][:4])
        return EXIT_OK
    store = _store_for(project, job)
    if not store.exists():
        log.warning("result %s: job %r is not in Redis (deleted?); ignored", result, job)
        return EXIT_OK
    unit = unit_for_workunit(store, wu) or ""
    spec = spec_from_json(store.spec_json())
    spool = project.boincdl_dir / "spool"
    spool.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{result if is_safe_name(result) else 'result'}.", dir=spool))
    copies: list[Path] = []
    try:
        if _late_call(store, wu, "a missing-files call" if missing else "a late result"):
            return EXIT_OK
        state = store.unit_states_of([unit])[0] if unit else None
        if state == "cancelled":
            # the job ended (or the unit was cancelled) while this result ran: BOINC still
            # validates and assimilates a cancelled workunit's late success
            log.info("%s (%s): late result of a cancelled unit; nothing recorded", unit, result)
            forget_workunit(store.r, job, wu)
            return EXIT_OK
        if missing:
            reason = f"result files missing on the server: {', '.join(Path(m).name for m in missing)}"
            if unit and store.unit_states_of([unit])[0] in UNIT_DONE:
                # the file deleter removed the files of a unit already merged or given up
                log.info("%s: %s; the unit is already %s, nothing recorded", unit, reason,
                         store.unit_states_of([unit])[0])
            else:
                store.record_rejection(unit or wu, result, reason)
                out = assimilate_error(store, unit or wu, reason)
                log.warning("%s: %s -> %s", unit or wu, reason, out.status)
            forget_workunit(store.r, job, wu)
            return EXIT_OK
        try:
            copies = copy_result(call.files, work, spec.units.max_upload_bytes)
            out = assimilate_files(store, copies, spec, result, unit=unit or None)
        except ResultRejected as e:
            store.record_rejection(unit or wu, result, e.reason)
            out = AssimilationOutcome("rejected", unit or wu, reason=e.reason)
        except (StoreUnavailable, UnknownJob):
            raise
        except Exception as e:  # noqa: BLE001 - a bug must not stop every assimilation
            reason = f"internal error while assimilating: {type(e).__name__}: {e}"
            log.error("%s: %s\n%s", unit, reason, traceback.format_exc())
            _keep(project, store, unit, copies, weights=True)
            store.record_rejection(unit, result, reason)
            assimilate_error(store, unit, reason)
            return EXIT_OK
        if out.status == "rejected" and unit and not store.is_assimilated(unit):
            # BOINC considers the workunit done: give up on it so the epoch can close.
            assimilate_error(store, unit, f"rejected at assimilation: {out.reason}")
        if wu:
            forget_workunit(store.r, job, wu)
        _keep(project, store, unit, copies, weights=project.settings.keep_weights or out.status == "rejected")
        log.info("%s (%s): %s%s", unit or wu, result, out.status, f" ({out.reason})" if out.reason else
                 f", weights version {out.version}")
        return EXIT_OK
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _keep(project: BoincProject, store: JobStore, unit: str, copies: Sequence[Path], weights: bool) -> None:
    """Keep the metrics (and, if asked, the weights) under the job's results directory.

    ``unit`` comes from BOINC's names and the job's own records, and the directory is
    still built through :func:`confined`: nothing a host wrote picks a path.
    """
    if not unit or not copies or not is_safe_name(unit):
        return
    job_dir = store.meta().get("job_dir") or str(project.job_dir(store.job))
    results = Path(job_dir) / "results"
    results.mkdir(parents=True, exist_ok=True)
    dest = confined(results, unit)
    dest.mkdir(exist_ok=True)
    from boinc_dl.server.validator.checks import identify_files

    try:
        files = identify_files(copies)
    except ResultRejected:
        return
    if files.metrics is not None:
        shutil.copyfile(files.metrics, dest / "metrics.json")
    if weights:
        shutil.copyfile(files.weights, dest / "weights_out.h5")


def _assimilate_error(project: BoincProject, call: ScriptCall) -> int:
    from boinc_dl.server.assimilator.core import assimilate_error

    mask = int(call.error_mask or 0)
    wu = call.wu_name
    if not wu and call.wu_id is not None:
        wu = lookup_wu_name(project, call.wu_id)
    if not wu:
        # Release 1.2 passes only the id; without database access it cannot be mapped.
        r = connect(project.redis_url(), timeout=5.0)
        r.hset(UNRESOLVED_KEY, str(call.wu_id), json.dumps({"mask": mask, "t": time.time()}))
        log.error("workunit #%s failed (mask %d) but its name could not be looked up; recorded in %s",
                  call.wu_id, mask, UNRESOLVED_KEY)
        return EXIT_OK
    parsed = parse_unit_name(wu)
    if not parsed:
        log.warning("workunit %s failed (mask %d): not a boinc-dl unit name; ignored", wu, mask)
        return EXIT_OK
    store = _store_for(project, parsed["job"])
    if not store.exists():
        log.warning("workunit %s failed: job %r is not in Redis; ignored", wu, parsed["job"])
        return EXIT_OK
    reason = describe_mask(mask)
    # A regenerated unit (re-issue policy "fresh") runs as <unit>_r<n>: its failures
    # are the unit's, while a workunit it superseded (cancelled by boinc-dl) is not.
    if _late_call(store, wu, f"an error call (mask {mask})"):
        return EXIT_OK
    unit = wu
    if store.unit_info(wu) is None:
        unit = unit_name(parsed["job"], parsed["epoch"], parsed["shard"], parsed["model"])
    forget_workunit(store.r, store.job, wu)
    state = store.unit_states_of([unit])[0]
    if state in UNIT_DONE:
        log.info("%s: the unit is already %s; nothing to record", wu, state)
        return EXIT_OK
    out = assimilate_error(store, unit, reason)
    log.info("%s: %s -> %s", wu, reason, out.status)
    return EXIT_OK


def lookup_wu_name(project: BoincProject, wu_id: int) -> str | None:
    """A workunit's name from BOINC's database (read-only, credentials from config.xml);
    None when that is not possible."""
    from boinc_dl.server.backends.boinc.boincdb import BoincDB, BoincDBError

    try:
        with BoincDB.connect(project) as db:
            name = db.workunit_name(wu_id)
    except BoincDBError as e:
        log.warning("lookup of workunit #%d failed: %s", wu_id, e)
        return None
    if not name:
        log.warning("lookup of workunit #%d: no such workunit", wu_id)
    return name


# ---- validator ----------------------------------------------------------------------------

def validate_init(project: BoincProject, argv: Sequence[str], tokens: Sequence[str] | None = None) -> int:
    """``script_validator --init_script``: is this result well-formed and for a known unit?"""
    try:
        call = parse_call(argv, tokens)
    except ValueError as e:
        log.error("cannot parse the arguments %s: %s", list(argv), e)
        return EXIT_TRANSIENT
    if not call.files:
        log.error("called without result files (argv %s); on 1.6.x servers declare "
                  "--init_script with a single token", list(argv))
        return EXIT_TRANSIENT
    tmp = Path(tempfile.mkdtemp(prefix="bdl-validate."))
    try:
        return _validate_one(project, call.files, tmp, call)
    except (StoreUnavailable, TransientFault) as e:
        log.error("transient fault, BOINC will validate again later: %s", e)
        return EXIT_TRANSIENT
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _validate_one(project: BoincProject, paths: Sequence[str], tmp: Path, call: ScriptCall) -> int:
    from boinc_dl.server.common.spec import spec_from_json
    from boinc_dl.server.validator import norms
    from boinc_dl.server.validator.checks import unit_for_workunit, validate_result

    result = result_name_of(paths[0])
    missing = check_files(paths)
    if missing:
        log.warning("result %s invalid: files missing: %s", result, missing)
        return EXIT_INVALID
    job, wu = _identity(call, paths)
    if not job:
        log.warning("result %s invalid: BOINC names no boinc-dl workunit for it", result)
        return EXIT_INVALID
    store = _store_for(project, job, project.settings.validator_redis_wait_s)
    try:
        spec_json = store.spec_json()
    except UnknownJob:
        log.warning("result %s invalid: job %r is not in Redis", result, job)
        return EXIT_INVALID
    spec = spec_from_json(spec_json)
    unit = unit_for_workunit(store, wu) or ""
    try:
        if not unit:
            raise ResultRejected(f"workunit {wu!r} is not a unit of job {job!r}")
        copies = copy_result(paths, tmp, spec.units.max_upload_bytes)
        res = validate_result(copies, store, spec.units.max_upload_bytes, unit)
        bound, source = norms.bound_for(store, spec, res.weights.model)
        ws, _ = store.get_weights(res.weights.model)
        if ws.size == res.weights.flat.size:
            reason = norms.check_distance(float(np.linalg.norm(res.weights.flat - ws)), bound, source)
            if reason:
                raise ResultRejected(reason)
    except ResultRejected as e:
        store.record_rejection(unit or wu, result, e.reason)
        log.warning("result %s of %s invalid: %s", result, unit or wu, e.reason)
        return EXIT_INVALID
    log.info("result %s of %s valid", result, unit)
    return EXIT_OK


def validate_compare(project: BoincProject, argv: Sequence[str], tokens: Sequence[str] | None = None) -> int:
    """``script_validator --compare_script``: do two replicas of a unit agree?

    They match when they are for the same unit and their weight updates differ by at
    most ``compare_tolerance`` relative to the larger update (``||W1-W2|| /
    max(||W1-W0||, ||W2-W0||)``, W0 the unit's input weights; relative to the weights
    themselves when W0 is gone). A host that skips training (W = W0) or returns
    garbage does not match an honest one.
    """
    try:
        call = parse_call(argv, tokens)
    except ValueError as e:
        log.error("cannot parse the arguments %s: %s", list(argv), e)
        return EXIT_TRANSIENT
    paths = call.files + call.files2
    groups = split_results(paths)
    if len(groups) != 2 or not all(groups):
        log.error("compare needs the files of two results, got %s", list(argv))
        return EXIT_TRANSIENT
    tmp = Path(tempfile.mkdtemp(prefix="bdl-compare."))
    try:
        return _compare(project, groups, tmp, call)
    except (StoreUnavailable, TransientFault) as e:
        log.error("transient fault, BOINC will compare again later: %s", e)
        return EXIT_TRANSIENT
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _compare(project: BoincProject, groups: list[list[str]], tmp: Path, call: ScriptCall) -> int:
    from boinc_dl.server.common.spec import spec_from_json
    from boinc_dl.server.validator.checks import identify_files, unit_for_workunit

    idents = {_identity(ScriptCall(), g) for g in groups}
    job, wu = idents.pop() if len(idents) == 1 else ("", "")
    if not job:
        log.info("compare: the results are not replicas of one boinc-dl workunit: no match")
        return EXIT_INVALID
    store = _store_for(project, job, project.settings.validator_redis_wait_s)
    try:
        spec = spec_from_json(store.spec_json())
    except UnknownJob:
        return EXIT_INVALID
    unit = unit_for_workunit(store, wu)
    info = store.unit_info(unit) if unit else None
    if info is None:
        return EXIT_INVALID
    fp = store.fingerprint(str(info.get("model", "0")))
    bound = spec.units.max_upload_bytes
    flats = []
    for k, g in enumerate(groups):
        if check_files(g):
            log.warning("compare: files of result %d missing", k + 1)
            return EXIT_INVALID
        try:
            copies = copy_result(g, tmp / str(k), bound)
            wf = read_weights(identify_files(copies).weights, fp, bound)
        except (ResultRejected, WeightsFormatError) as e:
            log.warning("compare: result %d unreadable: %s", k + 1, e)
            return EXIT_INVALID
        if (wf.job, wf.unit) != (job, unit):
            log.info("compare: result %d embeds %s/%s, issued for %s/%s: no match", k + 1, wf.job[:80],
                     wf.unit[:80], job, unit)
            return EXIT_INVALID
        flats.append(wf.flat)
    w1, w2 = flats
    if not (np.isfinite(w1).all() and np.isfinite(w2).all()):
        return EXIT_INVALID
    ref = _input_weights(store, unit, fp)
    diff = float(np.linalg.norm(w1 - w2))
    if ref is not None:
        scale = max(float(np.linalg.norm(w1 - ref)), float(np.linalg.norm(w2 - ref)))
    else:
        scale = max(float(np.linalg.norm(w1)), float(np.linalg.norm(w2)))
    rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
    tol = project.settings.compare_tolerance
    log.info("compare %s: relative difference %.4g (tolerance %.4g)", unit, rel, tol)
    return EXIT_OK if rel <= tol else EXIT_INVALID


def _input_weights(store: JobStore, unit: str, fp: Any) -> np.ndarray | None:
    """The unit's input weights (the server's own file, recorded in Redis), or None."""
    info = store.unit_info(unit) or {}
    path = (info.get("files") or {}).get(WEIGHTS_IN)
    if not path or not Path(path).is_file():
        return None
    try:
        return read_weights(path, fp).flat
    except WeightsFormatError:
        return None


def setup_logging(name: str) -> None:
    """Log lines on stderr (the daemon's log file), prefixed by the script's name."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {name}: %(levelname)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S")

