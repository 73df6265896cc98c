"""The host side of a BOINC job's units, from BOINC's own records (its ``result`` table).

A BOINC job's merge records (the store's, the rows a ``units.csv`` holds) carry the
durations the client app measured on its own clock (``wall_s``: the app from its start
to its last write) and the assimilator's. BOINC knows what the app cannot see:

* ``elapsed_time``: the task's wall time on the host as the BOINC client measured it,
  which includes what runs around the app (the wrapper, a Docker app version's container
  start, reading the inputs from the slot directory); ``cpu_time`` its CPU seconds;
* ``sent_time`` and ``received_time``: the server's clock when the scheduler sent the
  result and when the client reported it back (whole seconds).

From them, per returned result:

* **host-side overhead** per unit = ``elapsed_time`` - the app's own ``wall_s`` of the
  same unit (only where both are known: the merged result of each merged unit);
* **network and queue** = (``received_time`` - ``sent_time``) - ``elapsed_time``: the
  download of the inputs, waiting in the client's queue for a slot, the upload, and the
  wait for the client's next scheduler request to report it. With the generator's window
  (units in flight until merged) equal to the slots, this latency holds a window place,
  so the plan counts it per unit (``dispatch_s``).

Values a host reports (``elapsed_time``, ``cpu_time``) are untrusted, and the table may
hold anything: every value is bounded, and a row that cannot be right (negative or
absurd durations, received before sent, longer on the host than between send and
receipt) is ignored and counted by reason. Medians throughout, overall and per host.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from boinc_dl.server.common.workunit import parse_unit_name, unit_name

#: BOINC's ``result.outcome`` success and ``result.validate_state`` invalid
#: (``db/boinc_db_types.h``); the planner may not import the BOINC backend.
OUTCOME_SUCCESS = 1
VALIDATE_INVALID = 2
#: The longest duration believed (as the assimilator bounds a host's durations).
MAX_S = 30 * 86400.0
#: ``sent_time``/``received_time`` are whole seconds: an elapsed time up to this much
#: longer than its turnaround is rounding, not a lie.
CLOCK_SLACK_S = 1.0
#: A unit's CPU seconds above this many times its elapsed time are not one host's.
MAX_CPU_PER_ELAPSED = 256.0
#: Rows read from the table and hosts listed in the report, at most.
MAX_RESULTS = 100_000
HOSTS_SHOWN = 8


class ResultRecord(Protocol):
    """One returned result as BOINC recorded it (``boincdb.ResultTiming`` has these)."""

    name: str
    workunit: str
    hostid: int
    outcome: int
    validate_state: int
    sent_time: float | None
    received_time: float | None
    elapsed_time: float | None
    cpu_time: float | None
    canonical: bool


@dataclass(frozen=True)
class HostTimes:
    """One host's results: how many, and the medians of its per-unit times."""

    hostid: int
    results: int
    elapsed_s: float
    network_queue_s: float
    overhead_s: float | None  # None: none of its results was a merged unit's


@dataclass(frozen=True)
class BoincTimes:
    """The host side of a job's units by BOINC's account (see the module docstring)."""

    source: str
    results: int  # successful results with believable times
    failed: int  # returned results of other outcomes (errors, no reply, invalid)
    paired: int  # of them, merged units whose app wall time is known too
    elapsed_s: float  # median elapsed_time
    cpu_s: float | None  # median cpu_time (None: none believable)
    overhead_s: float | None  # median elapsed_time - the app's wall_s (None: nothing paired)
    network_queue_s: float  # median turnaround - elapsed_time
    hosts: tuple[HostTimes, ...] = ()
    ignored: dict[str, int] = field(default_factory=dict)  # reason -> rows
    unpaired_units: int = 0  # merged units without a believable result received before their merge

    def describe(self) -> str:
        """One paragraph: what was read and what it says."""
        cpu = f", CPU {self.cpu_s:.3f} s" if self.cpu_s is not None else ""
        over = (f"host-side overhead {self.overhead_s:.3f} s per unit (elapsed - the app's own wall time, "
                f"{self.paired} merged units)" if self.overhead_s is not None else
                "host-side overhead unknown (no merged unit's result found)")
        ign = (f"; ignored {sum(self.ignored.values())} rows: "
               + ", ".join(f"{n} {why}" for why, n in sorted(self.ignored.items())) if self.ignored else "")
        unp = (f"; {self.unpaired_units} merged units without a usable result" if self.unpaired_units else "")
        return (f"{self.results} successful results of {self.source} ({self.failed} failed, "
                f"{len(self.hosts)} hosts): elapsed {self.elapsed_s:.3f} s{cpu} (medians); {over}; "
                f"network and queue {self.network_queue_s:.3f} s per unit (received - sent - elapsed){ign}{unp}")

    def spread(self) -> str:
        """The spread of the hosts' medians (the fleet is not one machine)."""
        if len(self.hosts) < 2:
            return "one host"
        e = [h.elapsed_s for h in self.hosts]
        n = [h.network_queue_s for h in self.hosts]
        o = [h.overhead_s for h in self.hosts if h.overhead_s is not None]
        out = (f"per-host medians over {len(self.hosts)} hosts: elapsed {min(e):.3f}-{max(e):.3f} s, "
               f"network and queue {min(n):.3f}-{max(n):.3f} s")
        if len(o) > 1:
            out += f", host-side overhead {min(o):.3f}-{max(o):.3f} s"
        return out


def _num(v: Any, lo: float = 0.0, hi: float = MAX_S) -> float | None:
    """A finite float in [lo, hi], else None (a column's NULL, NaN-like or absurd value)."""
    if v is None or isinstance(v, bool):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return x if math.isfinite(x) and lo <= x <= hi else None


@dataclass(frozen=True)
class _Good:
    rec: ResultRecord
    elapsed: float
    received: float
    network_queue: float
    cpu: float | None


def _check(r: ResultRecord, ignored: Counter[str]) -> _Good | None:
    """The result's times if they can be right; else count why not and None."""
    e = _num(r.elapsed_time)
    if e is None or e <= 0:
        ignored["elapsed_time missing, negative or absurd"] += 1
        return None
    sent, received = _num(r.sent_time, 1.0, 1e11), _num(r.received_time, 1.0, 1e11)
    if sent is None or received is None or received < sent or received - sent > MAX_S:
        ignored["sent/received times missing or out of order"] += 1
        return None
    turnaround = received - sent
    if e > turnaround + CLOCK_SLACK_S:
        ignored["elapsed_time longer than its turnaround"] += 1
        return None
    cpu = _num(r.cpu_time, 0.0, e * MAX_CPU_PER_ELAPSED)
    if cpu is None and r.cpu_time is not None:
        ignored["cpu_time absurd (the row's other times kept)"] += 1
    return _Good(r, e, received, max(0.0, turnaround - e), cpu)


def _base_unit(job: str, workunit: str) -> str | None:
    """The unit a workunit of ``job`` runs (a regenerated ``<unit>_r<n>`` runs ``<unit>``);
    None for another job's (``job_x__...`` also starts with ``job_`` + ``_``)."""
    p = parse_unit_name(workunit)
    if p is None or p["job"] != job:
        return None
    return unit_name(job, p["epoch"], p["shard"], p["model"])


def boinc_times(results: Iterable[ResultRecord], unit_rows: Iterable[Mapping[str, Any]], job: str,
                source: str) -> BoincTimes:
    """Combine BOINC's returned results of ``job``'s workunits with the job's merge
    records (``unit``, the app's ``wall_s`` and the merge time ``t`` of each merged unit).

    The result a merge used is the unit's successful result received last before the
    merge (BOINC's canonical one first: with replicas, that is the one assimilated;
    a late result of a regenerated unit arrives after the merge and is not it).
    Raises ``ValueError`` when no result of the job has believable times.
    """
    ignored: Counter[str] = Counter()
    good: list[_Good] = []
    failed = 0
    for r in itertools.islice(results, MAX_RESULTS):
        if _base_unit(job, r.workunit) is None:
            continue  # another job whose name extends this one's: not ours, not counted
        if r.outcome != OUTCOME_SUCCESS or r.validate_state == VALIDATE_INVALID:
            failed += 1
            continue
        g = _check(r, ignored)
        if g is not None:
            good.append(g)
    if not good:
        why = (f" ({sum(ignored.values())} ignored: " + ", ".join(f"{n} {w}" for w, n in sorted(ignored.items()))
               + ")" if ignored else "")
        raise ValueError(f"{source}: no successful result of job {job!r} with believable times "
                         f"({failed} failed){why}: nothing to calibrate the host side from")
    by_unit: dict[str, list[_Good]] = defaultdict(list)
    for g in good:
        by_unit[_base_unit(job, g.rec.workunit) or ""].append(g)
    overhead: dict[str, float] = {}  # result name -> elapsed - the app's wall time
    unpaired = 0
    for row in itertools.islice(unit_rows, MAX_RESULTS):
        unit = row.get("unit")
        if row.get("failed") or not isinstance(unit, str):
            continue
        if unit not in by_unit:
            unpaired += 1
            continue
        wall = _num(row.get("wall_s"))
        if wall is None:
            unpaired += 1
            continue
        t = _num(row.get("t"), 1.0, 1e11)
        cands = [g for g in by_unit[unit] if t is None or g.received <= t + CLOCK_SLACK_S]
        if not cands:
            unpaired += 1
            continue
        g = max(cands, key=lambda g: (g.rec.canonical, g.received))
        if wall > g.elapsed + CLOCK_SLACK_S:
            ignored["app wall time longer than BOINC's elapsed_time"] += 1
            continue
        overhead[g.rec.name] = max(0.0, g.elapsed - wall)
    per_host: dict[int, list[_Good]] = defaultdict(list)
    for g in good:
        per_host[g.rec.hostid].append(g)
    hosts = []
    for hid, gs in per_host.items():
        ov = [overhead[g.rec.name] for g in gs if g.rec.name in overhead]
        hosts.append(HostTimes(hid, len(gs), statistics.median(g.elapsed for g in gs),
                               statistics.median(g.network_queue for g in gs),
                               statistics.median(ov) if ov else None))
    hosts.sort(key=lambda h: (-h.results, h.hostid))
    cpus = [g.cpu for g in good if g.cpu is not None]
    return BoincTimes(source, len(good), failed, len(overhead), statistics.median(g.elapsed for g in good),
                      statistics.median(cpus) if cpus else None,
                      statistics.median(overhead.values()) if overhead else None,
                      statistics.median(g.network_queue for g in good), tuple(hosts), dict(ignored), unpaired)
