"""Colluding attackers' results against the merge defences (never used by the package).

One home for the five attacks of docs/merge-rules.md ("Measured: poisoning"), used by the
simulated-order bench (``bench/bench_merge_rules.py``), the bench on the shipped merge
path (``bench/bench_loss_check.py --attack``) and the tests:

* ``zeros`` — towards the all-zero model;
* ``labelflip`` — towards a model the attacker trained on shifted labels (``y + 1``);
* ``alie`` — "a little is enough": ``mean - z * std`` of recent honest updates, a
  coherent shift of every coordinate;
* ``ipm`` — inner-product manipulation: minus the mean of recent honest updates;
* ``nudge`` — many small nudges: towards a target model (one trained on shifted labels),
  each at ``nudge_ratio`` of the median honest update norm.

Every attack but ``nudge`` is sized at 0.99x the bound in force (the attacker knows it:
the worst case), the update taken from ``ref`` (the unit's base ``W_b`` for the trusted
clip radius on ``||W_c - W_b||``, the server weights for 0.2's bound on
``||W_c - W_s||``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

ATTACKS = ("zeros", "labelflip", "alie", "ipm", "nudge")

#: Share of the bound an attacker's update is sized at (just inside it).
INSIDE = 0.99


@dataclass
class Attack:
    kind: str
    frac: float = 0.1            # share of units run by colluding attackers
    z: float = 1.0               # "a little is enough": mean - z*std
    nudge_ratio: float = 0.5     # many small nudges: this share of the median honest norm
    pattern: Callable[[int], bool] | None = None  # unit index -> attacker (single-attacker mode)

    def __post_init__(self) -> None:
        if self.kind not in ATTACKS:
            raise ValueError(f"unknown attack {self.kind!r} (one of {', '.join(ATTACKS)})")

    @property
    def trains(self) -> bool:
        """Whether the attacker trains a model of its own (on shifted labels) per unit."""
        return self.kind == "labelflip"


def craft(attack: Attack, ref: np.ndarray, bound: float | None, *, honest_updates: Sequence[np.ndarray] = (),
          honest_norms: Sequence[float] = (), trained: np.ndarray | None = None,
          target: np.ndarray | None = None, offset: np.ndarray | None = None) -> np.ndarray:
    """The attacker's result (float32 weights): ``ref`` plus an update in the attack's
    direction, of norm ``INSIDE * bound`` (the median honest norm while no bound is in
    force; ``nudge``: ``nudge_ratio`` x the median honest norm).

    ``honest_updates``: recent honest updates ``W_c - W_b`` the colluders saw (``alie``,
    ``ipm``; their direction is ``-ref`` before any); ``honest_norms``: recent honest update
    norms; ``trained``: the attacker's model trained on shifted labels from the unit's base
    (``labelflip``); ``target``: the nudges' target (zeros if None); ``offset``: added to
    the ``alie``/``ipm`` direction (``W_b - W_s``: the same update seen from ``W_s``)."""
    med = float(np.median(np.asarray(honest_norms, dtype=np.float64))) if len(honest_norms) else None
    size = INSIDE * bound if bound is not None else (med if med is not None else 1.0)
    kind = attack.kind
    if kind == "zeros":
        direction = -ref
    elif kind == "labelflip":
        if trained is None:
            raise ValueError("labelflip needs the attacker's trained model")
        direction = trained - ref
    elif kind == "nudge":
        direction = (target if target is not None else np.zeros_like(ref)) - ref
        size = attack.nudge_ratio * (med if med is not None else size)
    else:  # alie, ipm
        if not len(honest_updates):
            direction = -ref
        else:
            hs = np.stack(list(honest_updates))
            mu = hs.mean(0)
            direction = mu - attack.z * hs.std(0) if kind == "alie" else -mu
            if offset is not None:
                direction = direction + offset
    nrm = float(np.linalg.norm(direction))
    if nrm == 0 or not math.isfinite(nrm):
        return ref.astype(np.float32, copy=True)
    return (ref + direction * np.float32(size / nrm)).astype(np.float32)
