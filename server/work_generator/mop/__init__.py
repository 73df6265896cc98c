"""Model hopper parallelism (MOP): scheduling and search for Cerebro-style model selection.

* :mod:`.scheduler` -- :class:`MOPScheduler`, the randomized, replica-aware, fault-tolerant
  scheduler (push mode ``assign`` and BOINC pull mode ``issue``/``runnable``), with
  JSON-serialisable state; :mod:`.matching` its batch matching, :mod:`.assignment` what it
  hands out and the default partition placement.
* :mod:`.search` -- configurations, grid/random sampling of a search space (its grammar is
  :mod:`boinc_dl.server.common.space`) and :class:`SearchProcedure`, the epoch-boundary template;
* :mod:`.procedures` -- the AutoML procedures behind it (grid, random, successive halving,
  Hyperband, PBT) and :func:`make_search`.
* :mod:`.state` -- :class:`MopState`, MOP's own keys in Redis.

Pure Python + numpy. The schedule simulator and the exact MILP the scheduler is
measured against are test and bench machinery (``tests/support``), not installed.
"""

from boinc_dl.server.common.space import parse_space

from .assignment import Assignment, SchedulerError, round_robin_availability
from .procedures import PBT, GridSearch, Hyperband, RandomSearch, SuccessiveHalving, make_search
from .scheduler import POLICIES, MOPScheduler
from .search import Config, Decision, SearchProcedure, grid, sample_configs

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
