"""The units a finished job leaves open: cancelled in the job system and in the store.

A job can finish while units are in flight: its generator ends it (the last epoch
closed, fail-fast), or someone else does (``boinc-dl cancel`` sets its status from
another process). Either way no result of those units will be merged, so they are
cancelled, and ``boinc-dl status`` does not show a cancelled job with units still
"in progress".
"""

from __future__ import annotations

from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.base import JobSystem
from boinc_dl.server.common.states import OPEN


def cancel_open_units(store: JobStore, backend: JobSystem) -> int:
    """Cancel every open unit of the job (idempotent); returns how many there were."""
    n = 0
    for unit, state in store.unit_states().items():
        if state in OPEN:
            backend.cancel(unit)
            store.transition_unit(unit, state, "cancelled")
            n += 1
    return n
