"""The adaptive bound on update distances: poisoning by magnitude is rejected.

A result's distance from the server weights, ``||W_c - W_s||``, is compared with the
distances of this job's accepted results for the same model, kept in Redis (the last
:data:`WINDOW`). After ``update_norm_warmup`` accepted results, a distance over
``median + k * 1.4826 * MAD`` (the MAD scaled to a standard deviation; a robust
statistic: a few poisoned results accepted during the warm-up move it little) and over
:data:`MIN_RATIO` times the median is rejected. The fixed ``max_update_norm`` applies
from the first result. Honest distances shrink as training converges and vary by unit
(data subset, epoch); the median-ratio floor keeps a tight cluster of distances (MAD
near 0) from rejecting an honest result slightly above it.
"""

from __future__ import annotations

import math

import numpy as np

from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.spec import JobSpec

WINDOW = 256
MIN_RATIO = 4.0
MAD_TO_SD = 1.4826


def accepted_norms(store: JobStore, model: str) -> list[float]:
    """The most recent accepted update distances of ``model`` (newest first)."""
    return store.update_norms(model, WINDOW)


def adaptive_bound(norms: list[float], k: float | None, warmup: int) -> float | None:
    """``max(median + k * 1.4826 * MAD, MIN_RATIO * median)`` of ``norms``, or None
    before the warm-up (or with ``k`` None)."""
    if k is None or len(norms) < warmup:
        return None
    a = np.asarray(norms, dtype=np.float64)
    med = float(np.median(a))
    mad = float(np.median(np.abs(a - med)))
    return max(med + k * MAD_TO_SD * mad, MIN_RATIO * med)


def bound_for(store: JobStore, spec: JobSpec, model: str) -> tuple[float | None, str]:
    """The distance bound in force for ``model`` now, and where it comes from."""
    v = spec.validation
    fixed = v.max_update_norm
    # No adaptive bound configured: no read of the window (one round trip per merge saved).
    adaptive = None if v.update_norm_k is None else \
        adaptive_bound(accepted_norms(store, model), v.update_norm_k, v.update_norm_warmup)
    if adaptive is not None and (fixed is None or adaptive < fixed):
        return adaptive, f"median + {v.update_norm_k:g} MAD of accepted updates"
    return fixed, "max_update_norm"


def check_distance(dist: float, bound: float | None, source: str) -> str | None:
    """The rejection reason for ``dist`` under ``bound``, or None when it passes."""
    if not math.isfinite(dist):
        return f"update distance {dist} from the server weights is not finite"
    if bound is not None and dist > bound:
        return f"update distance {dist:.4g} from the server weights exceeds the bound {bound:.4g} ({source})"
    return None


def record_norm(store: JobStore, model: str, dist: float) -> None:
    """Add an accepted result's distance to the window (after its merge)."""
    store.push_update_norm(model, dist, WINDOW)
