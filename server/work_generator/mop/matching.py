"""The ``random-matching`` policy's batch decision: critical units first, then a maximum
matching of idle workers to idle models (Kuhn's augmenting paths)."""

from __future__ import annotations

import random
from collections.abc import Container, Mapping, Sequence
from typing import Any


def match_batch(ws: list[str], models: list[str], avail: Mapping[str, list[int]],
                pending: Sequence[Any], inflight: Container[str], left: Mapping[str, int],
                hold: list[int], rng: random.Random) -> list[tuple[str, str, int]]:
    """Critical units first, and a maximum matching of idle workers to idle models.

    A unit ``(m, j)`` is ranked by ``(max(left[m], pressure[j]), left[m])`` where
    ``left[m]`` is the number of units model ``m`` still has to do this epoch (it needs
    at least that many more sequential units) and ``pressure[j]`` the units left on
    partition ``j`` per worker holding it (the rounds its holders still need): the unit
    on the more critical of the two resources goes first; ties are broken at random.
    Each worker's eligible models are ordered that way and Kuhn's augmenting-path
    algorithm then starts as many units as possible at once. The partition of a matched
    (worker, model) pair is the most pressed one it holds (ties at random).
    """
    if len(ws) == 1:  # the common case in continuous time: no matching needed
        w = ws[0]
        best: tuple[float, int] = (-1.0, -1)
        cands: list[tuple[str, int]] = []
        for j in avail[w]:
            q = pending[j]
            # Within one partition the key grows with left[m]: find the top models first.
            nbest, ms = -1, []
            for m in q:
                if m in inflight:
                    continue
                n = left[m]
                if n > nbest:
                    nbest, ms = n, [m]
                elif n == nbest:
                    ms.append(m)
            if nbest < 0:
                continue
            pr = len(q) / hold[j]
            k = (nbest if nbest > pr else pr, nbest)
            if k > best:
                best, cands = k, [(m, j) for m in ms]
            elif k == best:
                cands.extend((m, j) for m in ms)
        if not cands:
            return []
        m, j = cands[rng.randrange(len(cands))]
        return [(w, m, j)]
    order = [m for m in models if m not in inflight and left.get(m, 0) > 0]
    rank = {m: rng.random() for m in order}  # random tie-break, shared by all workers
    order.sort(key=lambda m: (-left[m], rank[m]))
    adj: dict[str, list[str]] = {}
    choice: dict[tuple[str, str], list[int]] = {}
    for w in ws:
        mine = avail[w]
        if len(mine) == 1:  # one partition: the key is monotone in left[m], reuse order
            q = pending[mine[0]]
            adj[w] = [m for m in order if m in q]
            continue
        key: dict[str, tuple[float, int]] = {}
        top: dict[str, float] = {}
        for j in avail[w]:
            q = pending[j]
            pr = len(q) / hold[j]
            for m in q:
                if m in inflight:
                    continue
                n = left[m]
                k = (n if n > pr else pr, n)
                if m not in key or k > key[m]:
                    key[m] = k
                if m not in top or pr > top[m]:
                    top[m], choice[w, m] = pr, [j]
                elif pr == top[m]:
                    choice[w, m].append(j)
        adj[w] = sorted(key, key=lambda m, key=key: (-key[m][0], -key[m][1], rank[m]))
    owner: dict[str, str] = {}  # model -> worker

    def augment(w: str, seen: set[str]) -> bool:
        for m in adj[w]:
            if m in seen:
                continue
            seen.add(m)
            if m not in owner or augment(owner[m], seen):
                owner[m] = w
                return True
        return False

    unmatched = []
    for w in ws:  # greedy pass first: the cheap common case, and keeps priorities
        m = next((m for m in adj[w] if m not in owner), None)
        if m is None:
            unmatched.append(w)
        else:
            owner[m] = w
    for w in unmatched:  # then augmenting paths make the matching maximum
        if adj[w]:
            augment(w, set())
    out = []
    for m, w in owner.items():
        mine = avail[w]
        ps = mine if len(mine) == 1 else choice[w, m]
        out.append((w, m, ps[rng.randrange(len(ps))] if len(ps) > 1 else ps[0]))
    return out
