"""The planner: predict epoch time and cost of a fleet, and recommend one.

* :mod:`.model` — the performance model's inputs and closed forms (with the
  resource-sharing term for the server host's cores);
* :mod:`.sim` — the discrete-event simulation where queues form;
* :mod:`.prices` — the project's one dated price table (the fleet controller bills
  from it too) behind a small ``PriceBook`` interface;
* :mod:`.search` — candidates, cost, exact search and the greedy / genetic baselines;
* :mod:`.calibrate` — unit and merge times from a run's ``units.csv``;
* :mod:`.boinc_times` — a BOINC job's host side (wrapper overhead, network and queue
  time, per host) from BOINC's result table beside its merge records;
* :mod:`.fleetfile` — the planner's fleet schema (a planner-only file, or the
  ``planner:`` section of the fleet controller's ``fleet.yaml``);
* :mod:`.plot` — the time-versus-cost plot with its Pareto front.

It uses only :mod:`boinc_dl.server.common`; the CLI (``boinc-dl plan``), runs and the fleet
controller use it.
"""
