"""The docker stack's assimilation transport: results handed over through a spool directory.

BOINC's ``script_assimilator`` (in the BOINC server image, which has no usable
Python) calls the POSIX-sh shim ``bdl_assimilate_spool.sh``, which copies a result's
files into ``SPOOL/assimilate/<entry>/`` atomically (tmp dir + rename) and exits 0.
``boinc-dl boinc spool`` (this module), running in boinc-dl's own container, takes
each entry and hands it to the one assimilation path
(:func:`~boinc_dl.server.backends.boinc.intake.assimilate_upload`, the same as the
native ``bdl_assimilate`` script's), then deletes it.

Delivery is at least once: a crash between the merge and the deletion makes the
next pass find the entry again, and the merge's idempotency mark turns the re-run
into a no-op. An entry is removed by renaming it out of the queue first, so a crash
during deletion never leaves a half-deleted entry to be misread. Entries that can
never be attributed to a job (BOINC's file names name no boinc-dl workunit, a
malformed call) are moved to ``SPOOL/dead/`` with a ``reason`` file instead of being
lost. Redis being down is transient: the entry stays and is retried.

Entry layout (written by the shim)::

    argv       the script's arguments, one per line (BOINC's tokens)
    sources    "<copied name>\\t<original path>" per copied file, in argument order
    files/     the copied result files
    wu_name    optional: the workunit name looked up for a 1.2 ``--error`` call
    missing    optional: path arguments that were not files
    meta       time, host, cwd, number of files

With ``--queue validate`` it answers the synchronous validation requests of
``bdl_docker_dispatch.sh`` instead: each entry of ``SPOOL/validate/`` names a
subcommand (``validate-init`` or ``validate-compare``), the project and BOINC's
arguments; it runs ``$BDL_VALIDATE_COMMAND`` (default: this Python's
``-m boinc_dl.server.backends.boinc``) with them, writes ``stdout``, ``stderr`` and
finally ``rc`` into the entry and renames it to ``SPOOL/validate-done/`` for the
waiting shim.

Run several consumers with ``--mod N I`` (entry i goes to the consumer with
``crc32(name) % N == I``), as BOINC runs several assimilators.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.core import AssimilationOutcome
from boinc_dl.server.assimilator.store import DEFAULT_RETRY_S, JobStore
from boinc_dl.server.backends.boinc.artifacts import VERDICT_SUBCOMMANDS
from boinc_dl.server.backends.boinc.intake import (
    assimilate_give_up,
    assimilate_upload,
    identity_from_names,
    result_name_of,
)
from boinc_dl.server.backends.boinc.project import BoincProject
from boinc_dl.server.common.diskfaults import ServerResourceError
from boinc_dl.server.common.errors import StoreUnavailable
from boinc_dl.server.common.workunit import parse_unit_name

DEFAULT_SPOOL = "/var/lib/boinc-dl/spool"
QUEUE = "assimilate"
MAX_ATTEMPTS = 5  # unexpected errors on one entry before it is moved to dead/
STALE_TMP_S = 3600.0  # shim staging dirs older than this were abandoned by a killed shim


@dataclass
class EntryResult:
    """What happened to one spool entry."""

    entry: str
    action: str  # "done" | "dead" | "retry"
    status: str = ""  # the assimilation outcome's status when done
    job: str = ""
    unit: str = ""
    reason: str = ""

    def log_line(self) -> str:
        return json.dumps({k: v for k, v in self.__dict__.items() if v != ""}, sort_keys=True)


class SpoolConsumer:
    """Process the entries of ``spool/assimilate`` for BOINC project ``project`` against Redis ``r``."""

    def __init__(self, spool: str | Path, project: BoincProject, r: Any, mod: tuple[int, int] = (1, 0),
                 retry_s: float = DEFAULT_RETRY_S):
        self.spool = Path(spool)
        self.project = project
        #: how long one entry waits out an unreachable Redis before it is left for the next pass
        self.retry_s = retry_s
        self.queue = self.spool / QUEUE
        self.dead = self.spool / "dead"
        self.trash = self.spool / "trash"
        self.r = r
        self.n, self.i = mod
        if not (self.n >= 1 and 0 <= self.i < self.n):
            raise ValueError(f"--mod {self.n} {self.i}: need N >= 1 and 0 <= I < N")
        for d in (self.queue, self.dead, self.trash, self.spool / "tmp", self.spool / "locks"):
            d.mkdir(parents=True, exist_ok=True)

    # ---- queue ---------------------------------------------------------------------
    def mine(self, name: str) -> bool:
        return zlib.crc32(name.encode()) % self.n == self.i

    def pending(self) -> list[Path]:
        """This consumer's entries, oldest first (names start with a UTC timestamp)."""
        try:
            names = sorted(os.listdir(self.queue))
        except FileNotFoundError:
            return []
        return [self.queue / n for n in names if not n.startswith(".") and self.mine(n)]

    def run_once(self) -> list[EntryResult]:
        """One pass over the queue; stops early (entries kept) if Redis is down."""
        self.clean_trash()
        out: list[EntryResult] = []
        for entry in self.pending():
            res = self.process(entry)
            out.append(res)
            if res.action == "retry" and res.reason.startswith("redis"):
                break
        return out

    # ---- one entry -----------------------------------------------------------------
    def process(self, entry: Path) -> EntryResult:
        """Assimilate one entry; delete it when handled, keep it on a transient fault."""
        name = entry.name
        try:
            argv = _read_lines(entry / "argv")
            if argv[:1] == ["--error"]:
                return self._error_call(entry, argv)
            return self._result(entry, argv)
        except StoreUnavailable as e:
            return EntryResult(name, "retry", reason=f"redis: {e}")
        except ServerResourceError as e:  # the server's disk: retry, never bury the result
            return EntryResult(name, "retry", reason=str(e))
        except FileNotFoundError as e:
            # The shim renames a complete entry into the queue, so a missing piece means
            # someone tampered with it; keep what is left for inspection.
            return self._bury(entry, f"incomplete spool entry: {e}")
        except Exception:
            attempts = _bump_attempts(entry)
            tb = traceback.format_exc(limit=5)
            if attempts >= MAX_ATTEMPTS:
                return self._bury(entry, f"failed {attempts} times:\n{tb}")
            return EntryResult(name, "retry", reason=f"attempt {attempts}: {tb.strip().splitlines()[-1]}")

    def _result(self, entry: Path, argv: list[str]) -> EntryResult:
        paths = self._files(entry)
        missing = _read_lines(entry / "missing") if (entry / "missing").exists() else []
        if not paths and not missing:
            return self._bury(entry, f"the assimilator call carried no result files; argv: {argv}")
        # Identity from BOINC's names of the uploads (the shim's sources), never the files.
        originals = [line.split("\t", 1)[1] for line in _read_lines(entry / "sources") if "\t" in line]
        job, wu = identity_from_names(originals or missing or [str(p) for p in paths])
        if not job:
            names = [Path(p).name for p in originals or missing][:4]
            return self._bury(entry, f"result cannot be attributed to a job: BOINC's names {names} name no "
                                     "boinc-dl workunit")
        result = result_name_of((originals or missing)[0]) if (originals or missing) else ""
        store = JobStore(self.r, job, retry_s=self.retry_s)
        outcome = assimilate_upload(self.project, store, wu, result, paths, missing=missing)
        return self._done(entry, outcome, job)

    def _error_call(self, entry: Path, argv: list[str]) -> EntryResult:
        # 1.2: --error MASK WU_ID ; 1.6: --error MASK WU_NAME WU_ID BATCH
        try:
            mask = int(argv[1])
        except (IndexError, ValueError):
            return self._bury(entry, f"malformed --error call: {argv}")
        wu_name = argv[2] if len(argv) >= 4 else ""
        if not wu_name and (entry / "wu_name").exists():
            wu_name = (entry / "wu_name").read_text().strip()
        if not wu_name:
            return self._bury(entry, f"--error call for workunit id {argv[2:]} whose name could not be resolved")
        ident = parse_unit_name(wu_name)
        if ident is None:
            return self._bury(entry, f"workunit {wu_name!r} is not a boinc-dl unit")
        outcome = assimilate_give_up(JobStore(self.r, ident["job"], retry_s=self.retry_s), wu_name, mask)
        return self._done(entry, outcome, ident["job"])

    def _files(self, entry: Path) -> list[Path]:
        order = [line.split("\t", 1)[0] for line in _read_lines(entry / "sources")]
        files = entry / "files"
        rest = sorted(set(os.listdir(files)) - set(order))
        return [files / n for n in [*order, *rest] if (files / n).is_file()]

    # ---- outcomes ------------------------------------------------------------------
    def _done(self, entry: Path, outcome: AssimilationOutcome, job: str) -> EntryResult:
        if outcome.status == "ignored":
            # kept for the admin rather than lost: e.g. a job deleted while its results ran
            return self._bury(entry, outcome.reason, job=job, unit=outcome.unit)
        self._remove(entry)
        return EntryResult(entry.name, "done", outcome.status, job, outcome.unit, outcome.reason)

    def _bury(self, entry: Path, reason: str, job: str = "", unit: str = "") -> EntryResult:
        """Move an entry that can never be assimilated to dead/, with its reason."""
        (entry / "reason").write_text(reason + "\n")
        target = self.dead / entry.name
        if target.exists():
            target = self.dead / f"{entry.name}.{time.time_ns()}"
        os.rename(entry, target)
        return EntryResult(entry.name, "dead", job=job, unit=unit, reason=reason.splitlines()[0])

    def _remove(self, entry: Path) -> None:
        """Take the entry out of the queue in one rename, then delete it."""
        target = self.trash / f"{entry.name}.{os.getpid()}"
        os.rename(entry, target)
        shutil.rmtree(target, ignore_errors=True)

    def clean_trash(self) -> None:
        """Finish deletions interrupted by a crash; drop staging dirs of killed shims."""
        for p in self.trash.iterdir():
            shutil.rmtree(p, ignore_errors=True)
        now = time.time()
        for p in (self.spool / "tmp").iterdir():
            try:
                if now - p.stat().st_mtime > STALE_TMP_S:
                    shutil.rmtree(p, ignore_errors=True)
            except FileNotFoundError:
                pass


class ValidateRunner:
    """Answer the synchronous validation requests in ``spool/validate``."""

    SUBCOMMANDS = VERDICT_SUBCOMMANDS

    def __init__(self, spool: str | Path, command: list[str] | None = None, mod: tuple[int, int] = (1, 0),
                 timeout: float = 540.0):
        self.spool = Path(spool)
        self.queue = self.spool / "validate"
        self.done = self.spool / "validate-done"
        self.command = command or shlex.split(os.environ.get("BDL_VALIDATE_COMMAND", "")) or \
            [sys.executable, "-m", "boinc_dl.server.backends.boinc"]
        self.n, self.i = mod
        self.timeout = timeout
        for d in (self.queue, self.done):
            d.mkdir(parents=True, exist_ok=True)

    def run_once(self) -> list[EntryResult]:
        names = sorted(n for n in os.listdir(self.queue) if not n.startswith("."))
        return [self.process(self.queue / n) for n in names if zlib.crc32(n.encode()) % self.n == self.i]

    def process(self, entry: Path) -> EntryResult:
        """Run the validator for one request; the entry moves to validate-done/ with its rc."""
        try:
            sub = _read_lines(entry / "command")[0]
            project = (entry / "project").read_text().strip()
            argv = (entry / "argv").read_text().splitlines()
        except (OSError, IndexError) as e:
            return self._answer(entry, 3, b"", f"malformed validation request: {e}\n".encode(), "")
        if sub not in self.SUBCOMMANDS:
            return self._answer(entry, 2, b"", f"unknown validation subcommand {sub!r}\n".encode(), sub)
        cmd = [*self.command, sub, *(["--project", project] if project else []), "--", *argv]
        try:
            res = subprocess.run(cmd, capture_output=True, timeout=self.timeout)
            if res.returncode < 0:  # killed by a signal: no verdict, never "invalid" (artifacts.shim)
                why = f"validator killed by signal {-res.returncode}; BOINC judges the result again later\n"
                return self._answer(entry, 3, res.stdout, res.stderr + why.encode(), sub)
            return self._answer(entry, res.returncode, res.stdout, res.stderr, sub)
        except subprocess.TimeoutExpired:
            return self._answer(entry, 3, b"", f"validator timed out after {self.timeout:.0f}s\n".encode(), sub)
        except OSError as e:
            return self._answer(entry, 3, b"", f"cannot run {cmd[0]}: {e}\n".encode(), sub)

    def _answer(self, entry: Path, rc: int, out: bytes, err: bytes, sub: str) -> EntryResult:
        (entry / "stdout").write_bytes(out)
        (entry / "stderr").write_bytes(err)
        (entry / "rc.tmp").write_text(f"{rc}\n")
        os.rename(entry / "rc.tmp", entry / "rc")
        try:
            os.rename(entry, self.done / entry.name)
        except OSError:
            shutil.rmtree(entry, ignore_errors=True)
        reason = err.decode(errors="replace").strip().splitlines()[-1] if err.strip() else ""
        return EntryResult(entry.name, "done", status=f"{sub or 'validate'} rc={rc}", reason=reason)

    def clean_done(self, max_age_s: float = 3600.0) -> None:
        """Answers nobody collected (the shim gave up) are dropped after an hour."""
        now = time.time()
        for p in self.done.iterdir():
            try:
                if now - p.stat().st_mtime > max_age_s:
                    shutil.rmtree(p, ignore_errors=True)
            except FileNotFoundError:
                pass


def _read_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line != ""]


def _bump_attempts(entry: Path) -> int:
    f = entry / "attempts"
    try:
        n = int(f.read_text()) + 1
    except (OSError, ValueError):
        n = 1
    try:
        f.write_text(str(n))
    except OSError:
        pass
    return n


class _Stop:
    """Set by SIGTERM/SIGINT/SIGHUP: finish the current entry, then exit."""

    requested = False

    @classmethod
    def install(cls) -> None:
        def handler(signum: int, _frame: Any) -> None:
            cls.requested = True

        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, handler)


def _sleep(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not _Stop.requested and time.monotonic() < deadline:
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def _connect_retrying(url: str) -> Iterator[Any]:
    delay = 1.0
    while not _Stop.requested:
        try:
            yield connect(url)
            return
        except StoreUnavailable as e:
            print(json.dumps({"action": "wait", "reason": str(e)}), flush=True)
            _sleep(delay)
            delay = min(delay * 2, 30.0)


def _lock(spool: Path, queue: str, mod: tuple[int, int]) -> Any:
    """Hold this consumer's lock for the process's life (two consumers of one share
    would hand one entry over twice); None when another process holds it."""
    lock_path = spool / "locks" / f"{queue}-{mod[0]}-{mod[1]}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = open(lock_path, "w")  # noqa: SIM115 - held for the process lifetime
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return lock


def serve(spool: Path, project: BoincProject | None, queue: str = "assimilate", mod: tuple[int, int] = (1, 0),
          poll: float = 1.0, once: bool = False) -> int:
    """``boinc-dl boinc spool``: consume the queue until SIGTERM/SIGINT/SIGHUP (or one pass).

    Exit status: 0, 2 (bad setup: no spool, another consumer holds this share), or 3
    with ``once`` when Redis is down (the entries stay)."""
    if not spool.is_dir():
        print(f"spool directory {spool} does not exist", file=sys.stderr)
        return 2
    lock = _lock(spool, queue, mod)
    if lock is None:
        print(f"another consumer serves {queue} share {mod[1]} of {mod[0]} in {spool}", file=sys.stderr)
        return 2
    if queue == "validate":
        runner = ValidateRunner(spool, mod=mod)
        _Stop.install()
        while not _Stop.requested:
            results = runner.run_once()
            for res in results:
                print(res.log_line(), flush=True)
            if once:
                break
            runner.clean_done()
            if not results:
                _sleep(min(poll, 0.5))
        return 0
    if project is None:
        print("the assimilate queue needs the BOINC project (--project or BDL_PROJECT)", file=sys.stderr)
        return 2
    url = project.redis_url()
    if once:
        try:
            r = connect(url)
        except StoreUnavailable as e:
            print(str(e), file=sys.stderr)
            return 3
        results = SpoolConsumer(spool, project, r, mod).run_once()
        for res in results:
            print(res.log_line(), flush=True)
        return 3 if any(x.reason.startswith("redis") for x in results) else 0
    _Stop.install()
    for r in _connect_retrying(url):
        consumer = SpoolConsumer(spool, project, r, mod)
        delay = poll
        while not _Stop.requested:
            results = consumer.run_once()
            for res in results:
                print(res.log_line(), flush=True)
            if any(x.reason.startswith("redis") for x in results):
                delay = min(max(delay * 2, 1.0), 30.0)
            else:
                delay = poll
            if not any(x.action != "retry" for x in results):
                _sleep(delay)  # empty queue, or nothing could be handled this pass
    return 0
