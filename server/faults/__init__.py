"""Fault injection and exact-once auditing for the local backend (tests and benchmarks).

* :mod:`boinc_dl.server.faults.audit` — check a job's Redis state: every (epoch, subset) merged
  exactly once, the merge log, the marks and the weights version agree;
* :mod:`boinc_dl.server.faults.chaos` — a thread that SIGKILLs assimilator processes and Redis
  while a job runs, at chosen points of its progress;
* :mod:`boinc_dl.server.faults.harness` — run a job on a :class:`~boinc_dl.server.backends.local.LocalJobSystem`
  built with options ``run_job`` does not expose (preemption modes, synthetic units);
* :mod:`boinc_dl.server.faults.proxy` — a TCP proxy in front of Redis that drops a reply after
  Redis has executed the command (the "lost acknowledgement" fault).
"""
