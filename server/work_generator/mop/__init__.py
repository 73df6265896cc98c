"""Model hopper parallelism (MOP): scheduling and search for Cerebro-style model selection.

* :mod:`.scheduler` -- :class:`MOPScheduler`, the randomized, replica-aware, fault-tolerant
  scheduler (push mode ``assign`` and BOINC pull mode ``issue``/``runnable``), with
  JSON-serialisable state.
* :mod:`.search` -- search spaces (grid, random) and AutoML procedures acting at epoch
  boundaries (successive halving, Hyperband, PBT) behind :class:`SearchProcedure`.
* :mod:`.simulate` -- discrete-event simulation of schedules, invariant checker, lower bound.
* :mod:`.milp` -- the exact MILP (HiGHS) and an exhaustive solver for tiny instances.

Pure Python + numpy; ``highspy`` is only needed by :mod:`.milp`.
"""

from .scheduler import (
    POLICIES,
    Assignment,
    MOPScheduler,
    SchedulerError,
    round_robin_availability,
)
from .search import (
    PBT,
    Config,
    Decision,
    GridSearch,
    Hyperband,
    RandomSearch,
    SearchProcedure,
    SuccessiveHalving,
    grid,
    make_search,
    parse_space,
    sample_configs,
)

__all__ = [
    "POLICIES",
    "PBT",
    "Assignment",
    "Config",
    "Decision",
    "GridSearch",
    "Hyperband",
    "MOPScheduler",
    "RandomSearch",
    "SchedulerError",
    "SearchProcedure",
    "SuccessiveHalving",
    "grid",
    "make_search",
    "parse_space",
    "round_robin_availability",
    "sample_configs",
]
