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
  A late result of a workunit boinc-dl superseded or cancelled is answered 3 as well,
  before its files are looked at: BOINC then leaves it "not checked" (see
  :data:`EXIT_NOT_CHECKED`), never invalid.
* compare: each judged pair of replicas is recorded with whether BOINC sent them to the
  same host or user (``result.hostid``/``userid``), so the admin page shows how many
  comparisons were across hosts.
* output files are ``upload/<hash>/<result>_r<random>_<i>``; the file deleter removes
  them right after assimilation, so the assimilator copies what it keeps first.

Kept as one module (about 600 lines): BOINC's argument forms, the validator and the
assimilator share one parser and one set of exit-code rules, and read best together.
"""

from __future__ import annotations

import logging
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.framework import (
    Delivery,
    attempt_of,
    expected_of,
    unit_for_workunit,
)
from boinc_dl.server.assimilator.policy import update_distance
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.boinc.artifacts import job_upload_bound
from boinc_dl.server.backends.boinc.intake import (
    TransientFault,
    assimilate_give_up,
    assimilate_upload,
    check_files,
    copy_result,
    identity_from_names,
    result_name_of,
    split_results,
    store_for,
)
from boinc_dl.server.backends.boinc.project import BoincProject
from boinc_dl.server.backends.boinc.registry import (
    UNRESOLVED_KEY,
    BoincRegistry,
    record_unresolved_error,
)
from boinc_dl.server.common.diskfaults import ServerResourceError
from boinc_dl.server.common.errors import (
    ResultRejected,
    StoreUnavailable,
    UnknownJob,
    WeightsFormatError,
)
from boinc_dl.server.common.procs import owned_prefix, sweep_orphaned_dirs
from boinc_dl.server.common.spec import spec_from_json
from boinc_dl.server.common.weights import read_weights
from boinc_dl.server.common.workunit import OUTPUT_NAMES, WEIGHTS_IN, parse_unit_name
from boinc_dl.server.validator.checks import identify_files, validate_result

log = logging.getLogger("boinc-dl.scripts")

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_CONFIG = 2
EXIT_TRANSIENT = 3  # VAL_RESULT_TRANSIENT_ERROR (sched/validate_util2.h)
#: A late result of a superseded or cancelled workunit: neither valid nor invalid.
#: ``script_validator`` knows only 0 (valid), 3 (transient) and "anything else: invalid"
#: (``init_result``, ``sched/script_validator.cpp``); on 3 the validator leaves the result
#: untouched (``check_set``, ``sched/validate_util2.cpp``), and for a workunit with an
#: error mask (boinc-dl cancels every superseded workunit, ``bin/cancel_jobs``) the
#: transitioner has already set it to ``VALIDATE_STATE_NO_CHECK`` (``sched/transitioner.cpp``):
#: "not checked", no credit, no penalty for the host, and its files are deleted.
EXIT_NOT_CHECKED = EXIT_TRANSIENT


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


def _identity(call: ScriptCall, paths: Sequence[str]) -> tuple[str, str]:
    return identity_from_names(paths, call.wu_name)


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
    except (StoreUnavailable, TransientFault, ServerResourceError) as e:
        log.error("transient fault, BOINC will hand this workunit over again: %s", e)
        return EXIT_TRANSIENT


def _assimilate_result(project: BoincProject, call: ScriptCall) -> int:
    result = result_name_of(call.files[0])
    job, wu = _identity(call, call.files)
    if not job:
        log.error("result %s: BOINC names no boinc-dl workunit (files %s); nothing recorded",
                  result or "?", [Path(f).name for f in call.files][:4])
        return EXIT_OK
    store = store_for(project, job)
    out = assimilate_upload(project, store, wu, result, call.files)
    log.info("%s (%s): %s%s", out.unit or wu, result, out.status, f" ({out.reason})" if out.reason else
             f", weights version {out.version}")
    return EXIT_OK


def _assimilate_error(project: BoincProject, call: ScriptCall) -> int:
    mask = int(call.error_mask or 0)
    wu = call.wu_name
    if not wu and call.wu_id is not None:
        wu = lookup_wu_name(project, call.wu_id)
    if not wu:
        # Release 1.2 passes only the id; without database access it cannot be mapped.
        record_unresolved_error(connect(project.redis_url(), timeout=5.0), int(call.wu_id or 0), mask)
        log.error("workunit #%s failed (mask %d) but its name could not be looked up; recorded in %s",
                  call.wu_id, mask, UNRESOLVED_KEY)
        return EXIT_OK
    parsed = parse_unit_name(wu)
    if not parsed:
        log.warning("workunit %s failed (mask %d): not a boinc-dl unit name; ignored", wu, mask)
        return EXIT_OK
    out = assimilate_give_up(store_for(project, parsed["job"]), wu, mask)
    log.info("%s: %s -> %s", wu, out.reason, out.status)
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
    sweep_orphaned_dirs(Path(tempfile.gettempdir()), "bdl-validate.")
    tmp = Path(tempfile.mkdtemp(prefix=owned_prefix("bdl-validate")))
    try:
        return _validate_one(project, call.files, tmp, call)
    except (StoreUnavailable, TransientFault, ServerResourceError) as e:
        log.error("transient fault, BOINC will validate again later: %s", e)
        return EXIT_TRANSIENT
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _validate_one(project: BoincProject, paths: Sequence[str], tmp: Path, call: ScriptCall) -> int:
    result = result_name_of(paths[0])
    job, wu = _identity(call, paths)
    if not job:
        missing = check_files(paths)
        log.warning("result %s invalid: BOINC names no boinc-dl workunit for it%s", result,
                    f" (files missing: {missing})" if missing else "")
        return EXIT_INVALID
    store = store_for(project, job, project.settings.validator_redis_wait_s)
    try:
        spec_json = store.spec_json()
    except UnknownJob:
        log.warning("result %s invalid: job %r is not in Redis", result, job)
        return EXIT_INVALID
    # Before anything about the files: a late result of a workunit boinc-dl superseded or
    # cancelled is not the host's fault, and BOINC's file deleter may already have removed
    # its upload (it deletes a cancelled workunit's outputs).
    late = late_reason(store, wu)
    if late:
        BoincRegistry(store).record_late_result(wu, result, late)
        log.info("result %s of %s not checked: a late result, %s (BOINC keeps it 'not checked', "
                 "no credit, no penalty)", result, wu, late)
        return EXIT_NOT_CHECKED
    missing = check_files(paths)
    if missing:
        log.warning("result %s invalid: files missing: %s", result, missing)
        return EXIT_INVALID
    spec = spec_from_json(spec_json)
    unit = unit_for_workunit(store, wu) or ""
    try:
        if not unit:
            raise ResultRejected(f"workunit {wu!r} is not a unit of job {job!r}")
        bound = job_upload_bound(store, spec)
        copies = copy_result(paths, tmp, bound)
        expected = expected_of(store, unit)
        res = validate_result(copies, expected, bound)
        cap = spec.validation.max_update_norm
        if cap is not None:
            norm = update_distance(store, store.unit_info(unit) or {}, attempt_of(Delivery(wu, result)),
                                   expected.model, res.weights.flat, expected.fingerprint)
            if not norm <= cap:
                raise ResultRejected(f"update norm {norm:.4g} exceeds max_update_norm {cap:.4g}")
    except ResultRejected as e:
        store.record_rejection(unit or wu, result, e.reason)
        log.warning("result %s of %s invalid: %s", result, unit or wu, e.reason)
        return EXIT_INVALID
    log.info("result %s of %s valid", result, unit)
    return EXIT_OK


def late_reason(store: JobStore, wu: str) -> str | None:
    """Why a result of workunit ``wu`` is late and must not be judged: boinc-dl superseded
    the workunit (a regenerated unit now runs under another name) or cancelled its unit;
    None for a current workunit."""
    current = BoincRegistry(store).superseded_by(wu)
    if current is not None:
        return f"workunit superseded by {current}"
    unit = unit_for_workunit(store, wu)
    if unit and store.unit_states_of([unit])[0] == "cancelled":
        return "the unit was cancelled"
    return None


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
    sweep_orphaned_dirs(Path(tempfile.gettempdir()), "bdl-compare.")
    tmp = Path(tempfile.mkdtemp(prefix=owned_prefix("bdl-compare")))
    try:
        return _compare(project, groups, tmp, call)
    except (StoreUnavailable, TransientFault, ServerResourceError) as e:
        log.error("transient fault, BOINC will compare again later: %s", e)
        return EXIT_TRANSIENT
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _compare(project: BoincProject, groups: list[list[str]], tmp: Path, call: ScriptCall) -> int:
    from boinc_dl.server.assimilator.framework import unit_for_workunit
    from boinc_dl.server.common.spec import spec_from_json

    idents = {_identity(ScriptCall(), g) for g in groups}
    job, wu = idents.pop() if len(idents) == 1 else ("", "")
    if not job:
        log.info("compare: the results are not replicas of one boinc-dl workunit: no match")
        return EXIT_INVALID
    store = store_for(project, job, project.settings.validator_redis_wait_s)
    try:
        spec = spec_from_json(store.spec_json())
    except UnknownJob:
        return EXIT_INVALID
    unit = unit_for_workunit(store, wu)
    info = store.unit_info(unit) if unit else None
    if info is None:
        return EXIT_INVALID
    fp = store.fingerprint(str(info.get("model", "0")))
    bound = job_upload_bound(store, spec)
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
    matched = rel <= tol
    results = (result_name_of(groups[0][0]), result_name_of(groups[1][0]))
    same_host, same_user = replica_origin(project, results)
    BoincRegistry(store).record_comparison(unit, results, matched, same_host, same_user)
    log.info("compare %s: relative difference %.4g (tolerance %.4g); %s", unit, rel, tol,
             "same host" if same_host else "across hosts" if same_host is False else "hosts unknown")
    return EXIT_OK if matched else EXIT_INVALID


def replica_origin(project: BoincProject, results: tuple[str, str]) -> tuple[bool | None, bool | None]:
    """(same host, same user) of two results, from BOINC's database (None when unknown:
    no database access, or a result BOINC does not know)."""
    from boinc_dl.server.backends.boinc.boincdb import BoincDB, BoincDBError

    try:
        with BoincDB.connect(project) as db:
            who = db.result_hosts(results)
    except BoincDBError as e:
        log.warning("compare: who computed %s is unknown: %s", " and ".join(results), e)
        return None, None
    if len(who) != 2 or results[0] == results[1]:
        return None, None
    a, b = who[results[0]], who[results[1]]
    return a.hostid == b.hostid, a.userid == b.userid


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

