"""Baselines the merge defences are measured against (never used by the package).

``adaptive_bound``: the bound on update distances boinc-dl 0.2 applied — the median + k
MAD (with a floor of 4x the median) of the last 256 *accepted* distances. A patient
attacker feeds it with its own accepted results and ratchets it up (issue: 0.593 ->
7.42 over 17 attacker results); the trusted clip radius replaced it.
"""

from __future__ import annotations

import numpy as np

WINDOW = 256
MIN_RATIO = 4.0
MAD_TO_SD = 1.4826


def adaptive_bound(norms: list[float], k: float | None, warmup: int) -> float | None:
    """``max(median + k * 1.4826 * MAD, MIN_RATIO * median)`` of ``norms``, or None
    before the warm-up (or with ``k`` None)."""
    if k is None or len(norms) < warmup:
        return None
    a = np.asarray(norms, dtype=np.float64)
    med = float(np.median(a))
    mad = float(np.median(np.abs(a - med)))
    return max(med + k * MAD_TO_SD * mad, MIN_RATIO * med)
