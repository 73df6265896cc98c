"""A run's directory: which one (``--new`` numbers a fresh one beside the old), who owns it
(an exclusive lock: exactly one ``boinc-dl run`` per directory), and starting over
(``--overwrite``).

A second ``boinc-dl run`` on a directory in use gets one line and exit 2, whatever
flags it was given: two runs in one directory would share slot directories, close
epochs twice and both write the final model. The lock is
:class:`~boinc_dl.server.common.filelock.FileLock` on ``<run dir>/run.lock``, dropped
by the kernel however the run ends (SIGKILL included), so a crashed run never blocks
its ``--resume``.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from boinc_dl.server.common.errors import BoincDLError
from boinc_dl.server.common.filelock import FileLock, LockBusy
from boinc_dl.server.common.spec import JOB_NAME_RE, JobSpec

#: What to do when the run directory already holds a run of the job.
OnExisting = Literal["refuse", "resume", "new", "overwrite"]

LOCK_FILE = "run.lock"


def holds_run(run_dir: Path) -> bool:
    """True if ``run_dir`` holds a run's state or outputs (its Redis files, a summary)."""
    if (run_dir / "summary.json").exists():
        return True
    redis_dir = run_dir / "redis"
    return redis_dir.is_dir() and any(redis_dir.iterdir())


def numbered(spec: JobSpec, base: Path) -> tuple[JobSpec, Path]:
    """The first free ``<base>-N`` (N = 2, 3, ...), claimed by creating it, and the job
    renamed ``<name>-N`` so its runs tell apart in ``status`` and in a shared Redis."""
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in range(2, 100_000):
        name = f"{spec.name}-{n}"
        if not JOB_NAME_RE.match(name):
            raise BoincDLError(f"--new: job name {name!r} would be longer than 64 characters; "
                               "give the job a shorter name")
        candidate = base.with_name(f"{base.name}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return spec.model_copy(update={"name": name}), candidate
    raise BoincDLError(f"--new: no free numbered directory beside {base}")


#: What a run writes into its directory; ``--overwrite`` removes these and nothing else
#: (a run directory given with ``--run-dir`` may hold the user's own files too).
RUN_ENTRIES = ("redis", "files", "hosts", "upload", "boinc-dl.log", "local-backend.log", "summary.json",
               "history.json", "epochs.csv", "units.csv", "learning_curve.png", "learning_curves.png",
               "leaderboard.csv", "final_model.keras", "best_model.keras")


def clear(run_dir: Path) -> None:
    """Remove what an earlier run wrote into ``run_dir`` (:data:`RUN_ENTRIES`)."""
    for name in RUN_ENTRIES:
        p = run_dir / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


@dataclass
class ClaimedRun:
    """The directory this run owns (locked until :meth:`release`) and its spec (renamed by ``--new``)."""

    spec: JobSpec
    run_dir: Path
    lock: FileLock
    numbered: bool = False

    def release(self) -> None:
        self.lock.release()


def claim(spec: JobSpec, run_dir: Path, on_existing: OnExisting) -> ClaimedRun:
    """Choose and lock the run directory for ``spec``.

    ``new``: a numbered directory beside it (the same directory if it holds no run);
    ``overwrite``: its contents are removed first; ``refuse`` and ``resume`` take it as it
    is (whether the job exists is the store's to say: see
    :func:`~boinc_dl.server.work_generator.prepare.prepare_job`). A directory another run
    holds is :class:`~boinc_dl.server.common.filelock.LockBusy`.
    """
    run_dir = Path(run_dir).resolve()
    renamed = False
    if on_existing == "new" and holds_run(run_dir):
        spec, run_dir = numbered(spec, run_dir)
        renamed = True
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(run_dir / LOCK_FILE, f"boinc-dl run of {spec.name}")
    try:
        lock.acquire()
    except LockBusy as e:
        hint = "" if on_existing == "new" else "; or start a run beside it with --new"
        raise LockBusy(f"{e}: wait for it to finish or stop it{hint}", e.holder) from None
    if on_existing == "overwrite":
        try:
            clear(run_dir)
        except BaseException:
            lock.release()
            raise
    return ClaimedRun(spec, run_dir, lock, renamed)
