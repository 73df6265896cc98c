"""The BOINC job system: stage input files, create workunits with ``bin/create_work``.

Facts from BOINC's source that shape this driver (``tools/create_work.cpp``,
``tools/backend_lib.cpp``, ``tools/process_input_template.cpp``):

* create_work runs in the project directory (it finds ``config.xml`` and ``cgi-bin/``
  there) and reads the templates relative to it; the result template path is stored in
  the workunit record and read again for every result the transitioner creates.
* With ``--stdin`` each line describes one job but accepts only ``--wu_name``,
  ``--wu_template``, ``--result_template``, ``--command_line``, ``--remote_file``,
  ``--target_host``, ``--target_user``, ``--priority`` (not on 1.2) and physical file names;
  deadlines and retry limits are per call. So units are batched per (job, limits)
  and every call passes ``--delay_bound``, ``--min_quorum``, ``--target_nresults``,
  ``--max_error_results``, ``--max_total_results`` and ``--max_success_results``:
  the defaults (1 everywhere, 7 days on release 1.6; quorum 2 on 1.2) either never
  re-issue a lost unit or replicate every unit.
* Limits must satisfy error <= total, success <= total, target <= success, or
  create_work refuses the job.
* The batched insert is one SQL statement: a single duplicate name fails the whole
  call, so units already created (recorded in Redis after each successful call) are
  skipped, and a failed batch that reports a duplicate is retried unit by unit.

Re-issue policy ``fresh`` (VC-ASGD's ``vcasgd.reissue``): BOINC itself only re-issues a
lost result with the same inputs. For ``fresh`` this driver keeps, per unit, the name
of its current workunit; a unit is lost only by BOINC's own account, read from its
database (:mod:`boinc_dl.server.backends.boinc.boincdb`): a *sent* result passed its report deadline
(``report_deadline = sent_time + delay_bound``) or BOINC timed it out or saw it fail,
and no result is back. A workunit still queued in BOINC is never late, and one whose
result is back (waiting for the validator or the assimilator) is never regenerated.
:meth:`BoincJobSystem.regeneration_requests` hands lost units to the work generator,
which rebuilds them from the freshest weights, and
:meth:`BoincJobSystem.resubmit_regenerated` cancels the old workunit (``cancel_jobs``)
and creates ``<unit>_r<n>``. Regeneration stops one short of ``max_total_results``
workunits, after which BOINC's own re-issue of the last one takes over, so a unit
never runs more instances than the limit allows. A workunit named in the job's
``reissue_now`` set (the fleet controller's request when a cloud reclaims the host
running it) is handed over at once, without waiting for its deadline. So is a unit
whose final result the assimilator refused for what its host computed
(``validation.reissue_refused``, :meth:`BoincRegistry.reissue_refused`): its workunit is
finished, so nothing is cancelled, and another host computes the unit from the freshest
weights instead of its subset being skipped for the epoch. A workunit that is stuck
(results back, and the replica it needs can go to no host that has not had one) is
regenerated under either policy (``same``: from its own inputs); a MOP job's is
cancelled (:meth:`BoincJobSystem.cancel_stuck`), so that its sub-epoch runs again.

Every workunit created is kept in a ledger of live workunits
(``bdl:<job>:boinc:live``, name -> unit) until it is cancelled or the assimilator
has handled it; :meth:`BoincJobSystem.cancel_stray` cancels each live workunit whose
unit is merged or given up or that is no longer its unit's current one, and
:meth:`BoincJobSystem.cancel_all` every one of a job when the job ends, so that no
host downloads inputs that were removed with the job.

Inputs are staged once into the download hierarchy (``download/<hash>/<name>``, the
layout of ``dir_hier_path``, with the ``.md5`` cache file), either natively or with
``bin/stage_file --copy``. BOINC files are immutable: a name already staged with other
content is an error (except a unit's own description for a unit not created yet).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import redis

from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.base import JobSystem, RetryLimits
from boinc_dl.server.backends.boinc import artifacts
from boinc_dl.server.backends.boinc.boincdb import (
    VALIDATE_STATE_INCONCLUSIVE,
    WU_ERROR_CANCELLED,
    BoincDB,
    BoincDBError,
    Takers,
    WorkunitState,
)
from boinc_dl.server.backends.boinc.host_contact import host_wait_s
from boinc_dl.server.backends.boinc.hosts import HostCensus
from boinc_dl.server.backends.boinc.project import APP_NAME, BoincProject, BoincSettings
from boinc_dl.server.backends.boinc.quorum import replica_rule
from boinc_dl.server.backends.boinc.registry import BoincRegistry
from boinc_dl.server.backends.boinc.spotcheck import SpotChecks
from boinc_dl.server.common.errors import BoincDLError
from boinc_dl.server.common.spec import JobSpec, spec_from_json
from boinc_dl.server.common.states import OPEN, SETTLED
from boinc_dl.server.common.workunit import (
    WEIGHTS_IN,
    WU_JSON,
    Workunit,
    parse_unit_name,
    unit_name,
)

log = logging.getLogger(__name__)

#: Characters allowed in physical file and workunit names (they go through create_work's
#: whitespace/quote tokenizer, SQL and URLs unescaped).
SAFE_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,250}$")
TOOL_TIMEOUT_S = 600.0
#: Task size from the job's history: samples needed, refresh period, bound / estimate.
FPOPS_MIN_SAMPLES = 3
FPOPS_REFRESH_S = 60.0
FPOPS_BOUND_FACTOR = 20.0
#: The estimate is this quantile of the measured task sizes, times FPOPS_MARGIN. BOINC's
#: deadline check admits as many queued tasks as *predicted* runtimes fit in delay_bound:
#: predicting the median lets a host queue tasks that the slower half of runs push past
#: the deadline (seen on a real server: 1-CPU hosts took 2-4 tasks of 30-40 s against a
#: 60 s deadline, and the queued ones were aborted as late).
FPOPS_QUANTILE = 0.9
FPOPS_MARGIN = 1.2
#: Before measurements: predicted runtime this fraction of the deadline on the median
#: active host, so a host holds at most two such tasks per CPU until the job's own tasks
#: are measured.
CALIBRATION_FRACTION = 0.5


#: The lowest ``--priority`` a workunit gets (an epoch this old and older share it).
PRIORITY_FLOOR = -1_000_000


def send_priority(epoch: int) -> int:
    """The ``--priority`` of a workunit of ``epoch`` (``Workunit.epoch``): 0 for epoch 1, one lower
    per epoch after.

    BOINC's scheduler sends the highest-scoring jobs first, and a job's score is 0 plus
    its result's priority (``JOB::get_score``, ``sched/sched_score.cpp``; results inherit
    the workunit's, ``tools/backend_lib.cpp``); equal scores leave the order to an
    unstable sort from a random slot, and on a real server new results won most ties: an
    epoch-1 unit waited ten minutes while later epochs' units went out around it, and
    every epoch then closed at once, when it merged. With the older epoch's units scoring
    higher, a unit still queued is sent before any unit issued after its epoch, whatever
    its slot (a regenerated unit keeps its epoch). Never positive: BOINC reads a
    priority above 0 as "high" (``batch_accel``) and a project's
    ``reliable_on_priority`` threshold as "reliable hosts only", so other apps' jobs
    (priority 0) are never pushed back by boinc-dl's. It is passed on create_work's
    command line (one call per priority: release 1.2 takes no ``--priority`` on a
    ``--stdin`` line)."""
    return max(PRIORITY_FLOOR, 1 - max(1, int(epoch)))


class BoincToolError(BoincDLError):
    """A BOINC tool (create_work, stage_file, cancel_jobs) failed."""

    def __init__(self, message: str, returncode: int | None = None, stderr: str = ""):
        super().__init__(message)
        self.returncode = returncode
        self.stderr = stderr


@dataclass
class _Pending:
    wu: Workunit
    limits: RetryLimits
    name: str = ""  # the BOINC workunit name: the unit's own, or <unit>_r<n> once regenerated
    quorum: int = 0  # min_quorum and target_nresults (0: the project's)

    def __post_init__(self) -> None:
        self.name = self.name or self.wu.unit


def file_md5(path: Path) -> tuple[str, int]:
    """(md5 hex, size) of a file, read in 1 MiB blocks."""
    h = hashlib.md5(usedforsecurity=False)  # BOINC's file checksum, not a security hash
    n = 0
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            n += len(block)
    return h.hexdigest(), n


class BoincJobSystem(JobSystem):
    """Creates and cancels workunits of one BOINC project (see module docstring)."""

    def __init__(self, project: BoincProject | str | Path, r: redis.Redis,
                 settings: BoincSettings | None = None, batch_size: int | None = None):
        self.project = project if isinstance(project, BoincProject) else BoincProject(project)
        self.project.require()
        self.r = r
        self.settings = settings or self.project.settings
        self.batch_size = batch_size or self.settings.batch_size
        self.capacity = self.settings.capacity
        self._census: HostCensus | None = None
        self._pending: list[_Pending] = []
        self._staged: dict[str, str] = {}  # physical name -> md5 (verified this process)
        self._md5_cache: dict[tuple[str, int, int], tuple[str, int]] = {}
        self._specs: dict[str, JobSpec] = {}
        self._db: BoincDB | None = None
        self._fpops: dict[str, tuple[float, tuple[float, float]]] = {}
        self.spot_checks = SpotChecks(lambda job: JobStore(self.r, job), self._active_hosts)

    # ---- JobSystem ------------------------------------------------------------------------
    def live_capacity(self) -> int | None:
        """Slots of the hosts that contacted the scheduler recently, plus one spare unit
        per host (BOINC's host table, cached; None when the database is unreadable)."""
        return self._host_census().window()

    def _active_hosts(self) -> int | None:
        return self._host_census().hosts()

    def _host_census(self) -> HostCensus:
        if self._census is None:
            self._census = HostCensus(self.project)
        return self._census

    def submit(self, wu: Workunit, limits: RetryLimits) -> None:
        """Queue a unit for the next create_work batch (flushed when the batch is full)."""
        missing = [n for n in artifacts.INPUT_ORDER if n not in wu.files]
        if missing:
            raise BoincDLError(f"unit {wu.unit}: no input file for {', '.join(missing)}")
        if not SAFE_NAME.match(wu.unit):
            raise BoincDLError(f"unit name {wu.unit!r} is not a valid BOINC workunit name")
        self._queue(_Pending(wu, limits, self._workunit_name(wu)))

    def _workunit_name(self, wu: Workunit) -> str:
        """The workunit that carries ``wu``: a VC-ASGD unit its record says was regenerated
        (attempt > 0) runs as ``<unit>_r<attempt>``, so a daemon killed between regenerating
        a unit and creating its workunit creates that one on restart (the work generator's
        ``recover`` submits the unit again from its record), not the finished original."""
        if wu.mode != "vcasgd":
            return wu.unit
        info = JobStore(self.r, wu.job).unit_info(wu.unit) or {}
        try:
            attempt = int(info.get("attempt") or 0)
        except (TypeError, ValueError):
            attempt = 0
        return unit_name(wu.job, wu.epoch, wu.shard, wu.model, attempt) if attempt > 0 else wu.unit

    def _queue(self, item: _Pending) -> None:
        if not SAFE_NAME.match(item.name):
            raise BoincDLError(f"workunit name {item.name!r} is not a valid BOINC workunit name")
        if self.is_created(item.wu.job, item.name):
            log.info("workunit %s already exists in BOINC; not creating it again", item.name)
            return
        # a spot check for the loss check's trusted results, decided (and recorded) before
        # the workunit exists (:mod:`.spotcheck`)
        item.quorum = self.spot_checks.quorum(
            self._spec(item.wu.job), item.wu.unit, int((parse_unit_name(item.name) or {}).get("attempt", 0)),
            self.settings.min_quorum, int(item.limits.max_total_results))
        self._pending = [p for p in self._pending if p.wu.unit != item.wu.unit]
        self._pending.append(item)
        if len(self._pending) >= self.batch_size:
            self.flush()

    def cancel(self, unit: str) -> None:
        """Cancel a unit: drop it if still queued, ``bin/cancel_jobs --name`` on its
        current workunit if created."""
        before = len(self._pending)
        self._pending = [p for p in self._pending if p.wu.unit != unit]
        if len(self._pending) != before:
            return
        parsed = parse_unit_name(unit)
        name = unit
        if parsed:
            name = self._registry(parsed["job"]).current_instance(unit) or unit
            if not self.is_created(parsed["job"], name):
                log.debug("cancel %s: never created in BOINC", unit)
                return
        self._cancel_workunit(name)

    def _cancel_workunit(self, name: str, job: str | None = None) -> None:
        proc = self._run(["bin/cancel_jobs", "--name", name], check=False)
        if proc.returncode == 0:
            log.info("cancelled workunit %s", name)
        elif "No workunit named" in proc.stderr:
            log.warning("cancel %s: BOINC has no such workunit", name)
        if proc.returncode == 0 or "No workunit named" in proc.stderr:
            parsed = parse_unit_name(name)
            job = job or (parsed["job"] if parsed else None)
            if job:
                self._registry(job).cancelled(name)
        else:
            raise BoincToolError(
                f"bin/cancel_jobs --name {name} failed (exit {proc.returncode}): {_tail(proc.stderr)}",
                proc.returncode, proc.stderr)

    # ---- re-issue policy "fresh" ------------------------------------------------------------
    def regeneration_requests(self, job: str | None = None) -> list[tuple[str, int]]:
        """Units of ``job`` that BOINC lost, unmerged: (unit, attempt) (module docstring).

        Only for VC-ASGD jobs, and only with BOINC's database readable: without it nothing
        is regenerated (BOINC's own same-input re-issue still recovers lost results),
        because a guess from creation times regenerates units that merely waited in
        BOINC's queue. With ``vcasgd.reissue: same`` only :meth:`WorkunitState.stuck`
        workunits, which BOINC's re-issue cannot finish (the generator rebuilds those
        from the same inputs); with ``fresh`` every lost one, and refused ones.
        """
        if job is None:
            return []
        spec = self._spec(job)
        if spec.mode != "vcasgd" or spec.vcasgd is None:
            return []
        store = JobStore(self.r, job)
        if spec.vcasgd.reissue != "fresh":
            return self._lost_units(store, spec, set(), stuck_only=True)
        reg = BoincRegistry(store)
        # Workunits whose host the fleet controller saw reclaimed (it read BOINC's database
        # itself): honoured while still their unit's current, live workunit, so a request
        # never re-issues a unit twice; read once, then done with.
        asked = reg.take_reissue_requests()
        try:
            lost = self._lost_units(store, spec, asked)
        finally:
            reg.done_reissue_requests(asked)
        return sorted(set(lost) | set(self._refused_units(store, spec)))

    def _refused_units(self, store: JobStore, spec: JobSpec) -> list[tuple[str, int]]:
        """Units whose final result the assimilator refused and asked to issue again
        (:meth:`BoincRegistry.reissue_refused`): (unit, attempt) while the refused workunit
        is still the unit's current one and the unit is unsettled; a request a newer
        workunit or the unit's end has answered is dropped."""
        reg = BoincRegistry(store)
        pending = reg.refused_pending()
        if not pending:
            return []
        units = sorted(set(pending.values()))
        current = dict(zip(units, reg.issued(units), strict=True))
        states = dict(zip(units, store.unit_states_of(units), strict=True))
        out, done = [], []
        for wu, unit in pending.items():
            rec = current.get(unit)
            if states.get(unit) not in OPEN:
                done.append(wu)  # settled meanwhile
            elif rec and rec.get("name") == wu:
                if states.get(unit) == "in_progress":
                    out.append((unit, int(rec.get("attempt", 0))))
            elif rec and not reg.recorded_behind(rec, wu):
                done.append(wu)  # a newer workunit of the unit exists: it answered the request
            # else: BOINC has ``wu`` but the record of its creation is behind (a daemon
            # killed between create_work and recording it): its restart records it, then
            # the unit runs again
        reg.refused_done(done)
        if out:
            log.info("job %s: issuing %d unit(s) again whose result was refused", store.job, len(out))
        return out

    def _lost_units(self, store: JobStore, spec: JobSpec, asked: set[str],
                    stuck_only: bool = False) -> list[tuple[str, int]]:
        # Only the workunits BOINC may still run (the live ledger: units in flight), not
        # the job's every unit, on every pass.
        reg = BoincRegistry(store)
        live = reg.live()
        units = sorted(set(live.values()))
        if not units:
            return []
        cand: list[tuple[str, int, str]] = []
        for unit, rec in zip(units, reg.issued(units), strict=True):
            if not rec:
                continue
            # (the last workunit max_total_results allows is left to BOINC's own re-issue)
            if rec["name"] in live and int(rec["attempt"]) + 1 < spec.units.max_total_results:
                cand.append((unit, int(rec["attempt"]), str(rec["name"])))
        if not cand:
            return []
        states = store.unit_states_of([u for u, _, _ in cand])
        cand = [c for c, st in zip(cand, states, strict=True) if st == "in_progress"]
        if not cand:
            return []
        now_asked = {name for _, _, name in cand if name in asked}
        if now_asked:
            log.info("job %s: re-issuing %d unit(s) of reclaimed hosts now", store.job, len(now_asked))
        rest = [name for _, _, name in cand if name not in asked]
        wus = self.boinc_workunits(rest) if rest else {}
        now = time.time()
        takers = self._takers(wus or {}, now)

        stuck = {n for n, w in (wus or {}).items() if self._stuck(reg, w, now, takers)}

        def lost(w: WorkunitState) -> bool:
            return w.name in stuck or (not stuck_only and not w.stuck(now, takers) and w.overdue(now, takers))

        out = sorted((u, a) for u, a, name in cand
                     if name in now_asked or (wus is not None and name in wus and lost(wus[name])))
        for name in sorted(stuck):
            # the same words as a MOP job's (cancel_stuck): an operator can tell these apart
            # from units BOINC lost to a host
            log.warning("job %s: workunit %s is stuck (no host may take the replica it needs): "
                        "it is regenerated as a new workunit", store.job, name)
            reg.mark_stuck(name)
        return out

    @staticmethod
    def _stuck(reg: BoincRegistry, w: WorkunitState, now: float, takers: Takers | None) -> bool:
        """:meth:`WorkunitState.stuck`, except while BOINC's validator may still decide an
        undecided set (:meth:`revalidate_undecided`): not yet asked, or asked less than
        ``delay_bound`` ago. Otherwise a set first seen undecided after a long wait (a work
        generator down for a while) would be asked again and thrown away in one pass."""
        if not w.stuck(now, takers):
            return False
        if not w.undecided(now):
            return True
        asked = reg.revalidated(w.name)
        return asked is not None and now - asked > w.delay_bound

    def _takers(self, wus: dict[str, WorkunitState], now: float) -> Takers | None:
        """Who could take the unsent replicas of these workunits (:class:`Takers`), read only
        when one of them has waited long enough to be stuck; None when none has, or when
        BOINC's host table cannot be read (then the waits alone decide, logged)."""
        waited = [w for w in wus.values() if w.stuck(now)]
        if not waited:
            return None
        try:
            hosts = self._database().recent_hosts(max(w.delay_bound for w in waited))
        except BoincDBError as e:
            log.error("%s (stuck workunits judged by their waits alone this pass)", e)
            self._drop_db()
            return None
        return Takers(tuple(hosts), replica_rule(self.project.config_xml))

    def boinc_workunits(self, names: list[str]) -> dict[str, WorkunitState] | None:
        """BOINC's view of these workunits (None, logged, when its database is unreadable)."""
        try:
            return self._database().workunits(names)
        except BoincDBError as e:
            log.error("%s (no regeneration this pass)", e)
            self._drop_db()
            return None

    def _database(self) -> BoincDB:
        """The read-only session on BOINC's database, opened on first use and kept."""
        if self._db is None:
            self._db = BoincDB.connect(self.project)
        return self._db

    def _drop_db(self) -> None:
        """Close the session after a failure; the next call opens a fresh one."""
        if self._db is not None:
            self._db.close()
        self._db = None

    # ---- task size (rsc_fpops_est / rsc_fpops_bound) ---------------------------------------
    def task_fpops(self, job: str) -> tuple[float, float]:
        """``rsc_fpops_est`` and ``rsc_fpops_bound`` for the job's next workunits.

        BOINC predicts a task's runtime as ``rsc_fpops_est`` divided by the speed it
        assumes for the host, and sizes work requests and checks deadlines with that
        prediction; a client aborts a task that passes ``rsc_fpops_bound``. Once
        ``FPOPS_MIN_SAMPLES`` tasks of the job came back, the estimate is the slow end of
        their measured cost (``FPOPS_QUANTILE`` of ``elapsed_time * flops_estimate``, BOINC's
        own figures, start-up included, times ``FPOPS_MARGIN``); the job's first units are
        its calibration, sized by the settings.
        """
        default = (self.settings.rsc_fpops_est, self.settings.rsc_fpops_bound)
        if not self.settings.fpops_from_history:
            return default
        now = time.monotonic()
        cached = self._fpops.get(job)
        if cached is not None and now - cached[0] < FPOPS_REFRESH_S:
            return cached[1]
        value = default
        costs = None
        try:
            costs = self._database().job_task_costs(f"{job}__")
        except BoincDBError as e:
            log.warning("task size of job %s from the settings: %s", job, e)
            self._drop_db()
        if (not costs or len(costs) < FPOPS_MIN_SAMPLES) and self._db is not None:
            value = self._calibration_fpops(job, default)
        if costs and len(costs) >= FPOPS_MIN_SAMPLES:
            sizes = sorted(t * f for t, f in costs)
            est = sizes[min(len(sizes) - 1, int(FPOPS_QUANTILE * len(sizes)))] * FPOPS_MARGIN
            # the bound protects against runaway tasks, never against a slow host
            value = (est, max(est * FPOPS_BOUND_FACTOR, sizes[-1] * 4))
            if cached is None or abs(cached[1][0] - est) > 0.2 * cached[1][0]:
                log.info("job %s: rsc_fpops_est %.3g (slow end of %d tasks, median %.1f s each on the "
                         "hosts' speeds), bound %.3g", job, est, len(sizes),
                         sorted(t for t, _ in costs)[len(costs) // 2], value[1])
        self._fpops[job] = (now, value)
        return value

    def _calibration_fpops(self, job: str, default: tuple[float, float]) -> tuple[float, float]:
        """Before the job's own tasks are measured: an estimate that BOINC turns into a
        predicted runtime of at most ``CALIBRATION_FRACTION`` of the deadline on the
        median active host. The scheduler refuses a job whose predicted runtime, added
        to the host's queue, passes ``delay_bound`` (``sched/sched_check.cpp``), so the
        default estimate (an hour on a 1 GFLOPS host) with a 60 s deadline lets each
        host hold one task at a time."""
        assert self._db is not None
        try:
            speeds = sorted(self._db.host_fpops())
        except BoincDBError as e:
            log.warning("task size of job %s from the settings: %s", job, e)
            return default
        if not speeds:
            return default
        est = min(default[0], speeds[len(speeds) // 2] * self._spec(job).units.timeout_s * CALIBRATION_FRACTION)
        return est, max(default[1], est * FPOPS_BOUND_FACTOR)

    # ---- stray workunits ------------------------------------------------------------------
    def cancel_stray(self, job: str) -> int:
        """Cancel the job's live workunits that are no longer needed: their unit is merged,
        given up or cancelled, or they were superseded by a regenerated workunit."""
        store = JobStore(self.r, job)
        reg = BoincRegistry(store)
        live = reg.live()
        if not live:
            return 0
        units = sorted(set(live.values()))
        states = dict(zip(units, store.unit_states_of(units), strict=True))
        current = {u: (rec["name"] if rec else None) for u, rec in zip(units, reg.issued(units), strict=True)}
        stray = [wu for wu, unit in live.items()
                 if states.get(unit) in SETTLED or states.get(unit) is None
                 or (current.get(unit) is not None and current[unit] != wu)]
        return self._cancel_live(job, stray)

    def revalidate_undecided(self, job: str) -> int:
        """Ask BOINC's validator to judge again, once per workunit, each live workunit of
        ``job`` whose returned results it left undecided (:meth:`WorkunitState.undecided`:
        a quorum back, all inconclusive, the extra replica unsent); how many were asked.

        A validator that could not judge a result (boinc-dl's validator killed: its shim
        answers "transient") leaves the set waiting for a replica that a fleet of as many
        hosts as the quorum never takes; judged again, the results it could not read
        become valid and canonical, the unsent replica is not needed, and the unit merges
        with the work its hosts did (cancelling it, :meth:`cancel_stuck`, or regenerating
        it throws that work away and waits ``delay_bound`` first). Results that really
        disagree stay undecided, and the stuck path takes them as before. The write is
        ``need_validate = 1``, what BOINC's ``html/ops/revalidate.php`` does; it is made
        before the mark, so a daemon killed between the two asks once more at most."""
        reg = self._registry(job)
        live = reg.live()
        wus = self.boinc_workunits(sorted(live)) if live else None
        if not wus:
            return 0
        now = time.time()
        todo = [w for _, w in sorted(wus.items()) if w.undecided(now) and reg.revalidated(w.name) is None]
        if not todo:
            return 0
        asked = 0
        try:
            with BoincDB.connect(self.project, writable=True) as db:
                for w in todo:
                    changed = db.ask_revalidation(w.id)  # False: decided or ended meanwhile
                    if changed:
                        asked += 1
                        log.warning("job %s: BOINC's validator left workunit %s undecided (%d results back, none "
                                    "judged): asked it to judge them again", job, w.name,
                                    sum(r.validate_state == VALIDATE_STATE_INCONCLUSIVE for r in w.results))
                    reg.mark_revalidated(w.name, asked=changed)
        except BoincDBError as e:
            # No write access (or the database went away): the stuck path still ends these
            # workunits once their replica has waited delay_bound; say so once per workunit.
            log.error("job %s: %s; %d undecided workunit(s) wait for the stuck path instead", job, e, len(todo))
            for w in todo:
                reg.mark_revalidated(w.name, asked=False)  # a no-op for those asked before the error
        return asked

    def cancel_stuck(self, job: str) -> int:
        """Cancel the live workunits of a MOP job that are stuck (:meth:`WorkunitState.stuck`:
        results came back, and the replica BOINC needs could go to no host that has not had
        one). BOINC then hands each over as failed (``--error``), the unit is given up, and
        the MOP scheduler queues its sub-epoch again as a new attempt: a new workunit the same
        hosts may take. VC-ASGD jobs regenerate theirs instead (:meth:`regeneration_requests`);
        without BOINC's database nothing is cancelled."""
        if self._spec(job).mode != "mop":
            return 0
        live = self._registry(job).live()
        wus = self.boinc_workunits(sorted(live)) if live else None
        if not wus:
            return 0
        now = time.time()
        takers = self._takers(wus, now)
        reg = self._registry(job)
        stuck = sorted(name for name, w in wus.items() if self._stuck(reg, w, now, takers))
        for name in stuck:
            log.warning("job %s: workunit %s is stuck (no host may take the replica it needs): "
                        "cancelled, its sub-epoch runs again as a new workunit", job, name)
            reg.mark_stuck(name)  # before the cancel: BOINC's --error call for it reads the mark
            self._cancel_workunit(name, job)
        return len(stuck)

    def cancel_all(self, job: str) -> int:
        """Cancel every live workunit of a job that ended."""
        return self._cancel_live(job, list(self._registry(job).live()))

    def _cancel_live(self, job: str, names: list[str]) -> int:
        if not names:
            return 0
        wus = self.boinc_workunits(names)
        n = 0
        for name in sorted(names):
            if wus is not None and name in wus and not wus[name].live():
                # BOINC finished it already (assimilated, failed or cancelled): nothing to
                # do but the record; a cancel this daemon made before it was killed, and
                # did not record, counts now (once, whoever records it first)
                if wus[name].error_mask & WU_ERROR_CANCELLED:
                    self._registry(job).cancelled(name)
                else:
                    self._registry(job).forget(name)
                continue
            self._cancel_workunit(name, job)
            n += 1
        if n:
            log.info("job %s: cancelled %d workunit(s) no longer needed", job, n)
        return n

    def resubmit_regenerated(self, unit: str, wu: Workunit, name: str) -> bool:
        """Cancel ``unit``'s current workunit if BOINC may still run it, and queue the
        regenerated one as ``name`` (a refused result's workunit is finished: nothing to
        cancel, and its request to issue the unit again is answered)."""
        spec = self._spec(wu.job)
        reg = self._registry(wu.job)
        old = reg.current_instance(unit)
        if old is not None and old != name and self.is_created(wu.job, old) and reg.is_live(old):
            self._cancel_workunit(old, wu.job)
        limits = RetryLimits(spec.units.timeout_s, spec.units.max_error_results, spec.units.max_total_results)
        self._queue(_Pending(wu, limits, name))
        if old is not None and old != name:
            # a daemon killed before the new workunit is created re-creates it from the
            # unit's record on restart (VCASGDWorkGenerator.recover)
            reg.refused_done([old])
        return True

    def stop(self) -> None:
        """Create whatever is still queued."""
        self.flush()

    # ---- state ----------------------------------------------------------------------------
    def pending(self) -> list[str]:
        """Workunit names queued but not yet created."""
        return [p.name for p in self._pending]

    def is_created(self, job: str, unit: str) -> bool:
        return self._registry(job).is_created(unit)

    def _registry(self, job: str) -> BoincRegistry:
        return BoincRegistry(JobStore(self.r, job))

    def _mark_created(self, job: str, items: list[_Pending]) -> None:
        reg = self._registry(job)
        reg.mark_created(
            (i.name, i.wu.unit, self.deadline_s(i.limits), (parse_unit_name(i.name) or {}).get("attempt", 0))
            for i in items)
        # A workunit's own description is not <no_delete/>: BOINC's file deleter removes it
        # when the workunit is done. Removed at the job's end as well, the last workunits'
        # ones were gone when the file deleter came ("[CRITICAL] get_file_path: ... not
        # found" on a real server).
        reg.release_staged(Path(i.wu.files[WU_JSON]).name for i in items)

    def _spec(self, job: str) -> JobSpec:
        if job not in self._specs:
            self._specs[job] = spec_from_json(JobStore(self.r, job).spec_json())
        return self._specs[job]

    # ---- create_work ----------------------------------------------------------------------
    def flush(self) -> int:
        """Stage and create every queued unit; returns how many were created.

        On failure the units not created stay queued (a later flush retries them) and
        :class:`BoincToolError` is raised.
        """
        # one create_work call per (job, limits, quorum, priority): release 1.2 takes
        # --priority only on the command line, not on a --stdin line
        groups: dict[tuple[str, RetryLimits, int, int], list[_Pending]] = defaultdict(list)
        for p in self._pending:
            groups[(p.wu.job, p.limits, p.quorum, send_priority(p.wu.epoch))].append(p)
        created = 0
        for (job, limits, quorum, priority), items in groups.items():
            for i in range(0, len(items), self.batch_size):
                chunk = items[i : i + self.batch_size]
                self._create_batch(job, limits, chunk, quorum, priority)
                done = {p.name for p in chunk}
                self._pending = [p for p in self._pending if p.name not in done]
                created += len(chunk)
        return created

    def deadline_s(self, limits: RetryLimits) -> int:
        """``--delay_bound`` of a unit: its ``timeout_s`` plus the longest wait boinc-dl's
        settings impose on a host with a finished task (a restart's "project down"
        deferral, :func:`~boinc_dl.server.backends.boinc.host_contact.host_wait_s`), so a
        restart never makes a host miss a deadline."""
        return max(1, math.ceil(limits.delay_bound_s + host_wait_s(self.project.config)))

    def create_work_args(self, job: str, limits: RetryLimits, result_template: str,
                         disk_bound: float, quorum: int = 0, priority: int = 0) -> list[str]:
        """The command line (without stdin lines) for one batch of ``job``'s units
        (``quorum``: their ``min_quorum``; 0, the project's; ``priority``: their
        :func:`send_priority`)."""
        q = quorum or self.settings.min_quorum
        total = int(limits.max_total_results)
        errors = int(limits.max_error_results)
        if total < q:
            raise BoincDLError(
                f"job {job}: units.max_total_results ({total}) must be at least the quorum ({q})")
        if errors > total:
            raise BoincDLError(f"job {job}: units.max_error_results ({errors}) > max_total_results ({total})")
        est, bound = self.task_fpops(job)
        return [
            "bin/create_work",
            "--appname", APP_NAME,
            "--wu_template", artifacts.INPUT_TEMPLATE,
            "--result_template", result_template,
            "--delay_bound", str(self.deadline_s(limits)),
            "--min_quorum", str(q),
            "--target_nresults", str(q),
            "--max_error_results", str(errors),
            "--max_total_results", str(total),
            "--max_success_results", str(total),
            "--rsc_fpops_est", f"{est:.6g}",
            "--rsc_fpops_bound", f"{bound:.6g}",
            "--rsc_memory_bound", f"{self.settings.rsc_memory_bound:.6g}",
            "--rsc_disk_bound", f"{disk_bound:.6g}",
            "--priority", str(int(priority)),
            "--stdin",
        ]

    def _create_batch(self, job: str, limits: RetryLimits, items: list[_Pending], quorum: int = 0,
                      priority: int = 0) -> None:
        spec = self._spec(job)
        result_template = self.ensure_output_template(artifacts.job_upload_bound(JobStore(self.r, job), spec))
        lines: list[str] = []
        input_bytes = 0
        weights_bytes = 0
        for p in items:
            phys = [self.stage(Path(p.wu.files[name]), job, p.name, shared=name != WU_JSON)
                    for name in artifacts.INPUT_ORDER]
            sizes = [Path(p.wu.files[name]).stat().st_size for name in artifacts.INPUT_ORDER]
            input_bytes = max(input_bytes, sum(sizes))
            weights_bytes = max(weights_bytes, Path(p.wu.files[WEIGHTS_IN]).stat().st_size)
            lines.append(" ".join(["--wu_name", p.name, "--wu_template", artifacts.INPUT_TEMPLATE,
                                   "--result_template", result_template, *phys]))
        # slot copies of the inputs, the outputs and a checkpoint (model + optimizer state)
        disk_bound = 2.0 * input_bytes + 6.0 * weights_bytes + 256 * 1024 * 1024
        args = self.create_work_args(job, limits, result_template, disk_bound, quorum, priority)
        proc = self._run(args, stdin="".join(line + "\n" for line in lines), check=False)
        if proc.returncode == 0:
            self._mark_created(job, items)
            log.info("created %d workunit(s) of job %s (delay_bound %ss, quorum %s, %d errors / %d results)",
                     len(items), job, args[args.index("--delay_bound") + 1], args[args.index("--min_quorum") + 1],
                     limits.max_error_results, limits.max_total_results)
            return
        if "Duplicate entry" in proc.stderr and len(items) > 1:
            log.warning("create_work: a unit of the batch already exists; creating them one by one")
            for p in items:
                self._create_batch(job, limits, [p], quorum, priority)
            return
        if "Duplicate entry" in proc.stderr:
            log.warning("workunit %s already exists in BOINC (created before a restart)", items[0].name)
            self._mark_created(job, items)
            return
        raise BoincToolError(
            f"bin/create_work failed (exit {proc.returncode}) for {len(items)} unit(s) of job {job}: "
            f"{_tail(proc.stderr or proc.stdout)}", proc.returncode, proc.stderr)

    def ensure_output_template(self, max_nbytes: int) -> str:
        """Write the output template for this upload bound if missing; its project path."""
        gz = self.settings.gzip_outputs
        ri = self.settings.report_immediately
        rel = artifacts.output_template_name(max_nbytes, gz, ri)
        path = self.project.root / rel
        text = artifacts.output_template(max_nbytes, gz, ri)
        if path.exists():
            if path.read_text() != text:
                raise BoincToolError(f"{path} exists with other content; BOINC reads it for every "
                                     "result of existing units, so it is never rewritten: move it away")
            return rel
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, text)
        log.info("wrote output template %s", rel)
        return rel

    # ---- staging --------------------------------------------------------------------------
    def _md5(self, path: Path) -> tuple[str, int]:
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key not in self._md5_cache:
            self._md5_cache[key] = file_md5(path)
        return self._md5_cache[key]

    def stage(self, src: Path, job: str = "", unit: str = "", shared: bool = True) -> str:
        """Put ``src`` into the download hierarchy under its own name (once); the name.

        A file already there with the same content is reused (shared files are staged
        once per project). Different content under the same name is refused, except
        for a unit's own description when that unit does not exist in BOINC yet.
        """
        name = src.name
        if not SAFE_NAME.match(name):
            raise BoincDLError(f"input file name {name!r} is not a valid BOINC physical name")
        if not src.is_file():
            raise BoincDLError(f"input file {src} is missing")
        md5, size = self._md5(src)
        if self._staged.get(name) == md5:
            return name
        if job:
            self._registry(job).add_staged(name)
        dest = self.project.download_path(name)
        if dest.exists():
            have = _read_md5_file(dest) or file_md5(dest)
            if have == (md5, size):
                self._staged[name] = md5
                return name
            if shared or not unit or self.is_created(job, unit):
                raise BoincToolError(
                    f"{dest} exists with other content than {src}: BOINC files are immutable, "
                    "a new content needs a new name")
            log.warning("replacing staged %s (its unit was never created)", name)
            dest.unlink()
            Path(f"{dest}.md5").unlink(missing_ok=True)
        if self.settings.stage_mode == "stage_file":
            proc = self._run(["bin/stage_file", "--copy", str(src.resolve())], check=False)
            if proc.returncode != 0:
                raise BoincToolError(f"bin/stage_file --copy {src} failed (exit {proc.returncode}): "
                                     f"{_tail(proc.stdout + proc.stderr)}", proc.returncode, proc.stderr)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=dest.parent)
            os.close(fd)
            try:
                shutil.copyfile(src, tmp)
                os.chmod(tmp, 0o644)
                os.replace(tmp, dest)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            # BOINC's md5 cache file: "<md5> <nbytes>\n", newer than the file
            _atomic_write(Path(f"{dest}.md5"), f"{md5} {size}\n")
        self._staged[name] = md5
        return name

    def unstage_job(self, job: str) -> int:
        """Remove every file the job staged (its units are over); how many were removed."""
        reg = self._registry(job)
        n = self.unstage(reg.staged())
        reg.clear_staged()
        return n

    def unstage(self, names: list[str]) -> int:
        """Remove staged files (and their .md5/.gz) from the download hierarchy."""
        n = 0
        for name in names:
            dest = self.project.download_path(name)
            for p in (dest, Path(f"{dest}.md5"), Path(f"{dest}.gz")):
                if p.exists():
                    p.unlink()
                    n += p == dest
            self._staged.pop(name, None)
        return n

    # ---- processes ------------------------------------------------------------------------
    def _run(self, args: list[str], stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a project tool from the project directory, logged, with a timeout."""
        cmd = self.project.tool_command(args[0].removeprefix("bin/"), args[1:])
        log.debug("running %s (cwd %s)", " ".join(cmd), self.project.root)
        try:
            proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True,
                                  cwd=self.project.root, timeout=TOOL_TIMEOUT_S)
        except FileNotFoundError:
            raise BoincToolError(f"{cmd[0]}: not found (run from a BOINC project with its bin/ tools)") from None
        except subprocess.TimeoutExpired:
            raise BoincToolError(f"{' '.join(cmd[:3])} did not finish within {TOOL_TIMEOUT_S:.0f}s") from None
        if proc.stdout.strip():
            log.debug("%s: %s", args[0], _tail(proc.stdout))
        if check and proc.returncode != 0:
            raise BoincToolError(f"{' '.join(args)} failed (exit {proc.returncode}): {_tail(proc.stderr)}",
                                 proc.returncode, proc.stderr)
        return proc


def _read_md5_file(path: Path) -> tuple[str, int] | None:
    """BOINC's ``<file>.md5`` cache (md5 and size), if present, well-formed and not stale."""
    m = Path(f"{path}.md5")
    try:
        if m.stat().st_mtime < path.stat().st_mtime:
            return None
        md5, nbytes = m.read_text().split()
        return md5, int(float(nbytes))
    except (OSError, ValueError):
        return None


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _tail(text: str, n: int = 600) -> str:
    text = (text or "").strip()
    return text if len(text) <= n else "..." + text[-n:]
