"""Submit and cancel jobs on a BOINC project.

``submit_job`` prepares the job's shared files into ``<project>/boinc-dl/jobs/<name>``
and records it in Redis, marked for this project's BOINC backend; the work generator
daemon picks it up on its next pass. ``cancel_job`` stops a job and cancels its
workunits in BOINC.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.boinc.daemon import finalize_job
from boinc_dl.server.backends.boinc.jobsystem import BoincJobSystem
from boinc_dl.server.backends.boinc.project import BoincProject
from boinc_dl.server.common.errors import BoincDLError
from boinc_dl.server.common.filelock import FileLock, LockBusy
from boinc_dl.server.common.spec import JobSpec

log = logging.getLogger(__name__)


def submit_job(spec: JobSpec, project_dir: str | Path, resume: bool = False,
               search_path: Path | None = None) -> Path:
    """Prepare ``spec`` for the BOINC project at ``project_dir``; returns the job directory."""
    from boinc_dl.server.work_generator.prepare import prepare_job

    project = BoincProject(project_dir).require()
    if not (project.root / "templates" / "boincdl_in").is_file():
        raise BoincDLError(f"{project.root} is not set up for boinc-dl: run 'boinc-dl boinc install {project.root}'")
    if spec.units.max_total_results < project.settings.min_quorum:
        raise BoincDLError(f"job {spec.name}: units.max_total_results ({spec.units.max_total_results}) is below "
                           f"the project's min_quorum ({project.settings.min_quorum})")
    r = connect(project.redis_url())
    store = JobStore(r, spec.name)
    meta = store.meta() if store.exists() else {}
    if meta and meta.get("backend") == "boinc" and meta.get("boinc_project") not in (None, str(project.root)):
        raise BoincDLError(f"job {spec.name!r} belongs to another BOINC project ({meta.get('boinc_project')})")
    job_dir = project.job_dir(spec.name)
    job_dir.mkdir(parents=True, exist_ok=True)
    # One submit per job at a time: two would both find the job new and prepare it twice.
    try:
        lock = FileLock(job_dir / "submit.lock", f"boinc-dl submit of {spec.name}").acquire()
    except LockBusy as e:
        raise LockBusy(f"job {spec.name!r}: {e}; try again when it is done", e.holder) from None
    try:
        prepare_job(spec, store, job_dir, resume=resume, search_path=search_path,
                    slots=project.settings.capacity,
                    exists_message=f"job {spec.name!r} is already submitted to {project.root}: continue it "
                                   "with --resume, or give the job another name")
        store.set_meta(backend="boinc", boinc_project=str(project.root), boinc_submitted_at=time.time())
    finally:
        lock.release()
    log.info("job %s submitted to %s (job files in %s)", spec.name, project.root, job_dir)
    return job_dir


def cancel_job(project_dir: str | Path, job: str) -> tuple[str | None, int]:
    """Stop ``job`` and cancel its workunits in BOINC: (the status it had already finished
    with, ``None`` when this call cancelled it; how many workunits were cancelled)."""
    project = BoincProject(project_dir).require()
    r = connect(project.redis_url())
    store = JobStore(r, job).require()
    was = store.cancel()
    backend = BoincJobSystem(project, r)
    return was, finalize_job(store, backend)
