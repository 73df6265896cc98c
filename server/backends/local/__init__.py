"""The local backend: N simulated hosts x T slots and P assimilators on this machine.

* :mod:`.jobsystem` — :class:`LocalJobSystem`, the dispatcher (see its module docstring);
* :mod:`.slots` — the slot processes that run units for real;
* :mod:`.units` — unit and instance bookkeeping: deadlines, re-issue, regeneration;
* :mod:`.assimilators` — the assimilator pool and :func:`assimilate_message`;
* :mod:`.preemption` — simulated spot reclaims (kills, notices, crashes).
"""

from boinc_dl.server.backends.local.assimilators import assimilate_message
from boinc_dl.server.backends.local.jobsystem import PREEMPT_MODES, LocalJobSystem
from boinc_dl.server.backends.local.units import REISSUE_POLICIES

__all__ = ["PREEMPT_MODES", "REISSUE_POLICIES", "LocalJobSystem", "assimilate_message"]
