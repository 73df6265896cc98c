"""Test and bench machinery (never installed): fixtures' helpers, fault injection,
exactly-once audits, simulators and exact solvers used as references.

* :mod:`.audit` — check a job's Redis state: every (epoch, subset) merged exactly once;
* :mod:`.chaos` — SIGKILL assimilators and Redis while a job runs;
* :mod:`.harness` — run a job on a LocalJobSystem built with any of its options;
* :mod:`.proxy` — a TCP proxy in front of Redis that drops replies (lost acknowledgements);
* :mod:`.workfetch_sim` — BOINC clients' work fetch against the scheduler window, simulated;
* :mod:`.mop_simulate`, :mod:`.mop_milp` — MOP schedule simulation and the exact MILP;
* :mod:`.mop_replay` — replay a MOP job's finished-assignment log.
"""
