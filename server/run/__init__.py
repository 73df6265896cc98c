"""The runs of ``boinc-dl run`` on the embedded local backend.

* :mod:`.job` — :func:`run_job`: owns the private Redis and dispatches on the job's mode;
* :mod:`.lifecycle` — what both modes share (run directory, store, backend, counters, summary);
* :mod:`.vcasgd` — a VC-ASGD job; :mod:`.mop` — a MOP model-selection job;
* :mod:`.outputs` — history, learning curve and final model files;
* :mod:`.status` — ``boinc-dl status``: a job's state read from Redis.
"""

from boinc_dl.server.run.job import run_job
from boinc_dl.server.run.lifecycle import RunResult, default_run_dir, summary_table

__all__ = ["RunResult", "default_run_dir", "run_job", "summary_table"]
