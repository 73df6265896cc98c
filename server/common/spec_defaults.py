"""The settings a spec leaves out that depend on the data and the hosts, chosen once per job.

A minimal spec (name, mode, model, dataset, epochs) must train about as well as plain
Keras with the same model and epochs (``bench/bench_learning.py``; numbers in
bench/README.md, section "Defaults for a minimal spec"). Two things make VC-ASGD learn
more slowly per epoch than one process does, whatever the merge rule:

* **units in flight.** With ``k`` units in flight, each unit starts from weights that
  are about ``k`` merges old, so one merge moves the server copy by about ``1/k`` of what
  its unit learned (for the paper's ``W_s <- a*W_s + (1-a)*W_c`` with ``a = 0.5`` and
  ``k = 8``, a ninth). More training inside each unit (``training.local_epochs``) makes
  up for it; the bench measured how much is needed (``LOCAL_EPOCHS_PER_UNIT_IN_FLIGHT``).
* **tiny units.** A subset of a few dozen examples is a couple of optimizer steps per
  unit, most of the unit's time fixed costs (load weights and data, validate, write
  the result). ``vcasgd.n_subsets`` is one subset per slot, so that one round of units
  is one epoch, fewer when subsets would fall under ``MIN_SUBSET_EXAMPLES``, more (a
  multiple of the slots) when a subset would exceed ``MAX_SUBSET_EXAMPLES``, so that a
  unit stays short next to ``units.timeout_s`` and a preempted unit loses little.
  With fewer subsets than slots, ``vcasgd.window`` (units in flight) is the subsets
  per epoch: more in flight would start the next epochs' units from weights that have
  not learned from this epoch's yet (a job's three epochs would all train from its
  initial weights), and the local epochs and the merge rule follow that window.

MOP trains each model on each partition once per epoch (Cerebro's model hopping):
``training.local_epochs`` defaults to 1 there.

Derived values are written into the job's stored spec, so a resumed run, the
assimilators and BOINC's daemons all use the same ones, and the run prints them at the
start (:func:`describe`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from boinc_dl.server.common.spec import JobSpec

#: A subset holds at least this many examples (unless the data is smaller than one per slot).
MIN_SUBSET_EXAMPLES = 64
#: ... and at most this many: larger data gets more subsets (a multiple of the slots).
MAX_SUBSET_EXAMPLES = 10_000
#: Local epochs per unit in flight (rounded up), between LOCAL_EPOCHS_MIN and
#: LOCAL_EPOCHS_MAX (bench/README.md, "Defaults for a minimal spec").
LOCAL_EPOCHS_PER_UNIT_IN_FLIGHT = 1.0
LOCAL_EPOCHS_MIN = 4
LOCAL_EPOCHS_MAX = 16
#: Units in flight assumed when the job system cannot say (BOINC: hosts come and go).
DEFAULT_IN_FLIGHT = 8
#: Units in flight from which the derived merge rule is ``search`` (below: ``delta``). Chosen
#: on digits in the simulated order, scored on MNIST (docs/merge-rules.md, "The step
#: search"): from 32 in flight up it ends at least as well as delta and starts better; at
#: 8 it ends 0.6 points lower on digits and costs the server forward passes for nothing.
SEARCH_MIN_IN_FLIGHT = 32


@dataclass(frozen=True)
class Chosen:
    """One derived setting: its dotted field name, value, and why, in words."""

    field: str
    value: object
    why: str


def is_derived(spec: JobSpec) -> bool:
    """True when nothing is left to derive."""
    return not missing(spec)


def missing(spec: JobSpec) -> list[str]:
    """The fields of ``spec`` still to derive."""
    out = []
    if spec.mode == "vcasgd" and spec.vcasgd.n_subsets is None:
        out.append("vcasgd.n_subsets")
    if spec.mode == "vcasgd" and spec.vcasgd.merge_rule is None:
        out.append("vcasgd.merge_rule")
    if spec.training.local_epochs is None:
        out.append("training.local_epochs")
    return out


def in_flight(spec: JobSpec, slots: int | None) -> int:
    """Units in flight: ``vcasgd.window`` if set, else the job system's slots."""
    return int(spec.vcasgd.window or slots or DEFAULT_IN_FLIGHT)


def subsets_for(n_train: int, slots: int) -> tuple[int, str]:
    """VC-ASGD subsets per epoch for ``n_train`` examples on ``slots`` slots, and why."""
    slots = max(1, int(slots))
    per = n_train / slots
    if per < MIN_SUBSET_EXAMPLES:
        n = max(1, min(slots, n_train // MIN_SUBSET_EXAMPLES))
        return n, (f"{n_train:,} training examples: at least {MIN_SUBSET_EXAMPLES} per subset, "
                   f"fewer subsets than the {slots} slots")
    if per > MAX_SUBSET_EXAMPLES:
        rounds = math.ceil(n_train / (MAX_SUBSET_EXAMPLES * slots))
        n = rounds * slots
        return n, (f"{n_train:,} training examples on {slots} slots: {rounds} subsets per slot, "
                   f"at most {MAX_SUBSET_EXAMPLES:,} examples each")
    return slots, f"one subset per slot: {slots} slots, {n_train:,} training examples"


def window_why(n: int, slots: int) -> str:
    """Why a job with ``n`` subsets per epoch on ``slots`` slots keeps ``n`` units in flight."""
    return (f"{n} subsets per epoch on {slots} slots: more units in flight would start the next "
            f"epoch's units from weights that have not learned from this one's")


def local_epochs_for(k: int) -> tuple[int, str]:
    """Local epochs per unit with ``k`` units in flight, and why."""
    le = max(LOCAL_EPOCHS_MIN, min(LOCAL_EPOCHS_MAX, math.ceil(LOCAL_EPOCHS_PER_UNIT_IN_FLIGHT * k)))
    return le, f"{k} units in flight: each merge carries about 1/{k} of its unit's progress"


def merge_rule_for(k: int) -> tuple[str, str]:
    """The merge rule of a VC-ASGD job with ``k`` units in flight, and why."""
    if k >= SEARCH_MIN_IN_FLIGHT:
        return "search", (f"{k} units in flight: the server picks each result's step by the loss of a "
                          f"training sample at its weights (from {SEARCH_MIN_IN_FLIGHT} in flight it learns "
                          f"faster than delta)")
    return "delta", f"{k} units in flight: each result weighs about 1/{k} (below {SEARCH_MIN_IN_FLIGHT}: no search)"


def derive(spec: JobSpec, n_train: int, slots: int | None) -> tuple[JobSpec, list[Chosen]]:
    """``spec`` with every derived default filled in for ``n_train`` training examples and
    ``slots`` slots (None: the job system cannot tell), and what was chosen."""
    chosen: list[Chosen] = []
    vc, tr = spec.vcasgd, spec.training
    k = in_flight(spec, slots)
    if spec.mode == "vcasgd":
        if vc.n_subsets is None:
            n, why = subsets_for(n_train, k)
            vc = vc.model_copy(update={"n_subsets": n})
            chosen.append(Chosen("vcasgd.n_subsets", n, why))
            if vc.window is None and n < k:
                # Too few examples for a subset per slot: more units in flight than subsets
                # would issue the next epochs' units from weights that have not yet learned
                # from this epoch's (455 examples on 32 slots: 0.912 after 3 epochs, flat
                # from the first, in 17.8 s; 7 in flight: 0.921 / 0.939 / 0.947 in 13.2 s).
                vc = vc.model_copy(update={"window": n})
                chosen.append(Chosen("vcasgd.window", n, window_why(n, k)))
                k = n
        if tr.local_epochs is None:
            le, why = local_epochs_for(k)
            tr = tr.model_copy(update={"local_epochs": le})
            chosen.append(Chosen("training.local_epochs", le, why))
        if vc.merge_rule is None:
            rule, why = merge_rule_for(k)
            vc = vc.model_copy(update={"merge_rule": rule})
            chosen.append(Chosen("vcasgd.merge_rule", rule, why))
    elif tr.local_epochs is None:
        tr = tr.model_copy(update={"local_epochs": 1})
        chosen.append(Chosen("training.local_epochs", 1, "MOP: each model visits each partition once per epoch"))
    return spec.model_copy(update={"vcasgd": vc, "training": tr}), chosen


def fill_from(spec: JobSpec, stored: JobSpec) -> JobSpec:
    """``spec`` with the fields it leaves to derive taken from ``stored`` (the job's
    spec as first derived): a resumed job keeps its subsets, local epochs and merge rule."""
    vc, tr = spec.vcasgd, spec.training
    if vc.n_subsets is None:
        # the window derived with the subsets (none when there was a subset per slot)
        vc = vc.model_copy(update={"n_subsets": stored.vcasgd.n_subsets,
                                   "window": vc.window or stored.vcasgd.window})
    if vc.merge_rule is None:
        # a job stored before the rule was derived ran delta, the default then
        vc = vc.model_copy(update={"merge_rule": stored.vcasgd.merge_rule or "delta"})
    if tr.local_epochs is None:
        tr = tr.model_copy(update={"local_epochs": stored.training.local_epochs})
    return spec.model_copy(update={"vcasgd": vc, "training": tr})


def describe(chosen: list[Chosen]) -> list[str]:
    """``vcasgd.n_subsets = 8 (one subset per slot ...)`` lines for the start of a run."""
    return [f"{c.field} = {c.value}  ({c.why})" for c in chosen]
