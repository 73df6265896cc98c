"""Merge rules the parameter server can replay: name -> a pure function of its inputs.

A durable merge (``docs/parameter-server.md``, "Durability") logs what it did, not
the bytes it wrote: after a Redis crash the weights are rebuilt by replaying the
merges from a snapshot. A replay can only rebuild the same bytes if the merge of a
shard is a pure function of (the shard's current float32 values, the same slice of
the result's weights, the rule's parameters), computed with the same float ops in
the same order. So every rule a merge uses is registered here under a name, and the
merge record the caller passes to ``JobStore.merge`` names it (``record["rule"]``)
with its parameters (``record["rule_params"]``, a JSON object). The live merge and
the replay call the same registered function: they cannot drift apart.

A rule may not read anything else (a clock, a random draw, another key). A rule that
needs server state (a momentum, a staleness statistic) reads it before the merge and
puts the value it used in ``rule_params``; state that changes with every merge and
has the size of the model would have to be sharded and logged like the weights, which
no rule does yet.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

#: ``rule(ws, wc, params)``: the new value of one shard, computed in place in ``ws`` (a
#: writable float32 copy of the shard) from ``wc`` (the same slice of the result).
Rule = Callable[[np.ndarray, np.ndarray, Mapping[str, Any]], np.ndarray]

_RULES: dict[str, Rule] = {}


def register(name: str) -> Callable[[Rule], Rule]:
    """Decorator: make ``fn`` the replayable rule ``name`` (one definition per name)."""
    def deco(fn: Rule) -> Rule:
        if _RULES.get(name, fn) is not fn:
            raise ValueError(f"merge rule {name!r} is already registered")
        _RULES[name] = fn
        return fn
    return deco


def get(name: str) -> Rule | None:
    """The rule registered as ``name`` (None when there is none)."""
    return _RULES.get(name)


def apply(name: str, ws: np.ndarray, wc: np.ndarray, params: Mapping[str, Any]) -> np.ndarray:
    """Run rule ``name`` on one shard (``KeyError`` for an unknown rule)."""
    rule = _RULES.get(name)
    if rule is None:
        raise KeyError(f"no merge rule named {name!r} is registered")
    return rule(ws, wc, params)


def merge_into(ws: np.ndarray, wc: np.ndarray, alpha: float) -> np.ndarray:
    """``a*ws + (1-a)*wc`` computed in place in ``ws`` as ``a*(ws - wc) + wc``: three
    passes over float32 and no 20 MB temporary."""
    if alpha == 0.0:
        ws[:] = wc
        return ws
    ws -= wc
    ws *= np.float32(alpha)
    ws += wc
    return ws


@register("alpha")
def alpha_rule(ws: np.ndarray, wc: np.ndarray, params: Mapping[str, Any]) -> np.ndarray:
    """The papers' merge ``W_s <- a*W_s + (1-a)*W_c`` (MOP: ``a = 0``, a replacement)."""
    return merge_into(ws, wc, float(params["alpha"]))
