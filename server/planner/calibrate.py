"""Calibration from a job's own history: the ``units.csv`` a run writes.

Every merged unit's row carries the durations measured where they happened, each on its
own clock (``server/run/outputs.py``, ``UNIT_TIMINGS``):

* the client's: ``train_s`` (the training steps, wall), ``train_cpu_s`` (their CPU
  seconds, TensorFlow's threads included), ``wall_s`` and ``cpu_s`` (the whole unit:
  reading inputs, building the model, training, the final evaluation, checkpoints,
  writing the result), ``load_s``, ``eval_s``, ``checkpoint_s``, ``examples_seen``;
* the assimilator's: ``validate_s`` / ``validate_cpu_s`` (reading and checking the
  result), ``merge_s`` / ``merge_cpu_s`` (the whole ``JobStore.merge`` call and its CPU
  in the assimilator's thread) and ``commit_s`` (its waits for Redis' commits).

The calibration takes medians of those, never gaps between events: the time between two
merges is the merge cost only when the servers are the bottleneck, and in a run whose
clients are (a 1-slot calibration run, say) it is just the unit time.

* client compute **per example** (``compute_per_example_s``): CPU seconds of the training
  steps after the first over the examples the unit trained on (``(train_cpu_s -
  first_step_cpu_s) / examples_seen``), at most its wall time; per example, so any unit
  size and ``local_epochs`` follow from it;
* the unit's **first step** (``first_step_s``, from ``first_step_cpu_s``): a per-unit CPU
  cost that does not scale with the examples (setting the unit's seed before training
  clears TensorFlow's kernel cache: ~80 ms here against ~1.5 ms a step). Without it a
  per-example rate from units of 1,437 examples under-counted units of 479 by 40%;
* client **overhead** per unit (``overhead_s``): the unit's CPU (else wall) seconds
  outside its training steps;
* **merge** (``merge_s``): the assimilator's CPU seconds for validating and merging one
  result (else their wall time); **commit** (``commit_s``): the median wait for Redis;
* one-time and per-epoch costs of the pipeline: the first unit's extra wall time (a
  slot's first unit traces the model), and from ``epochs.csv`` beside it, the work
  generator's evaluation when it closes an epoch (``eval_s``) and the first one's extra;
* the **contention term** (:mod:`.contention`): each unit's time-averaged count of
  units running beside it (from its wall interval, ending where its validation began),
  and its CPU against what its size costs alone. The per-unit costs above come from the
  units that ran alone (at least three of them: a 1-slot run's), so that pooling a run
  of many slots calibrates ``g`` without inflating them.

A ``units.csv`` written before these columns existed still gives the client side from
``train_s`` and ``wall_s``; its server side is then unknown (the model's estimate is used,
and the plan says so). Bad input — no file, not a CSV, no merged unit with durations —
raises :class:`CalibrationError` with what is wrong.
"""

from __future__ import annotations

import csv
import itertools
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from boinc_dl.server.planner.boinc_times import BoincTimes
from boinc_dl.server.planner.contention import (
    ALONE_BELOW,
    MIN_CROWDED,
    Contention,
    fit_contention,
    mean_concurrency,
)

MAX_ROWS = 1_000_000  # a units.csv is ours, but bound what we read all the same
MAX_BYTES = 256 << 20
MAX_FIELD = 4096  # no field of units.csv is longer; a longer one is not our file


class CalibrationError(ValueError):
    """A units.csv (or run directory) that cannot calibrate the planner, and why."""


@dataclass(frozen=True)
class Calibration:
    """What a finished run's units say about one unit's client time and one merge."""

    source: str
    units: int  # merged units with client durations
    compute_per_example_s: float  # CPU seconds of training per example trained on
    overhead_s: float  # per unit, outside the training steps (load, evaluate, checkpoint, write)
    train_s: float  # median training wall time of a unit (as run, shared cores and all)
    wall_s: float  # median unit wall time on its slot (as run)
    examples_per_unit: float  # median examples a unit trained on (subset x local epochs)
    merge_s: float | None  # one result's validation + merge in its assimilator (CPU s; else wall)
    commit_s: float | None  # one merge's wait for Redis' commit
    validate_s: float | None  # one result's validation alone (included in merge_s)
    cpu_clock: bool  # True when CPU columns were recorded (False: wall times, an older units.csv)
    first_step_s: float = 0.0  # CPU of a unit's first training step (per unit, whatever its size)
    first_unit_extra_s: float = 0.0  # the first unit's extra wall time (a slot's first unit traces the model)
    eval_s: float = 0.0  # the generator's evaluation of the server weights when it closes an epoch
    first_eval_extra_s: float = 0.0  # ... and the extra of the first one (it loads the model)
    boinc: BoincTimes | None = None  # a BOINC job's host side, from BOINC's result table
    #: CPU per unit as a function of the units running at once (g = 0: not calibrated)
    contention: Contention = field(default_factory=Contention)

    @property
    def host_overhead_s(self) -> float:
        """Per unit on a host, around the app (BOINC's elapsed time - the app's wall
        time: wrapper, container start); 0 where unknown (not a BOINC calibration)."""
        return (self.boinc.overhead_s or 0.0) if self.boinc is not None else 0.0

    def unit_compute_s(self, examples: float) -> float:
        """Training seconds of a unit of ``examples`` examples alone on one slot: its first
        step, and the rest per example."""
        return self.first_step_s + self.compute_per_example_s * examples

    def describe(self) -> str:
        srv = (f"merge {self.merge_s * 1e3:.1f} ms (validate {self.validate_s * 1e3:.1f} ms), "
               f"Redis commit {self.commit_s * 1e3:.1f} ms" if self.merge_s is not None and
               self.validate_s is not None and self.commit_s is not None
               else "no server durations recorded (older units.csv): merge cost estimated from the model size")
        ev = (f"; epoch close: evaluation {self.eval_s:.3f} s (first +{self.first_eval_extra_s:.3f} s), "
              f"first unit +{self.first_unit_extra_s:.3f} s")
        return (f"{self.units} merged units of {self.source}: unit compute "
                f"{self.first_step_s:.3f} s first step + "
                f"{self.compute_per_example_s * 1e6:.1f} us/example x {self.examples_per_unit:,.0f} examples = "
                f"{self.unit_compute_s(self.examples_per_unit):.3f} s + {self.overhead_s:.3f} s overhead per unit "
                f"({'CPU' if self.cpu_clock else 'wall'} time; median unit wall {self.wall_s:.3f} s as run); {srv}{ev}; "
                f"{self.contention.describe()}")


def _float(v: Any, hi: float = 1e7) -> float | None:
    """A finite number in [0, hi) from a CSV field (or a record's number), else None."""
    if isinstance(v, bool):
        return None
    try:
        x = float(v) if v not in (None, "") else None
    except (TypeError, ValueError, OverflowError):
        return None
    return x if x is not None and x == x and 0 <= x < hi else None


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def units_csv_path(path: Path | str) -> Path:
    """``path`` itself, or ``path/units.csv`` for a run directory."""
    p = Path(path)
    if p.is_dir():
        p = p / "units.csv"
        if not p.is_file():
            raise CalibrationError(f"{path}: a run directory without units.csv (did the run merge any unit?)")
    elif not p.is_file():
        raise CalibrationError(f"{path}: no such file or run directory")
    return p


def _rows(p: Path) -> Iterable[dict[str, str]]:
    try:
        if p.stat().st_size > MAX_BYTES:
            raise CalibrationError(f"{p}: larger than {MAX_BYTES >> 20} MiB: not a units.csv")
        with p.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            if "unit" not in header or not {"train_s", "wall_s"} <= set(header):
                raise CalibrationError(
                    f"{p}: not a run's units.csv (its header needs unit, train_s and wall_s; "
                    f"found {', '.join(h[:20] for h in header[:8]) or 'nothing'})")
            for i, row in enumerate(reader):
                if i >= MAX_ROWS:
                    break
                if any(len(v) > MAX_FIELD for v in row.values() if isinstance(v, str)):
                    raise CalibrationError(f"{p}: row {i + 2} has a field over {MAX_FIELD} characters")
                yield row
    except UnicodeDecodeError:
        raise CalibrationError(f"{p}: not text (a units.csv is UTF-8 CSV)") from None
    except csv.Error as e:
        raise CalibrationError(f"{p}: not a CSV file ({e})") from None
    except OSError as e:
        raise CalibrationError(f"{p}: {e.strerror or e}") from None


def read_calibration(path: Path | str) -> Calibration:
    """Calibrate from a run directory or its ``units.csv`` (rows of failed units skipped)."""
    p = units_csv_path(path)
    ev, ev_first = _epoch_evals(p.parent / "epochs.csv")
    return calibration_from_rows(_rows(p), str(p), ev, ev_first)


def read_calibrations(paths: Sequence[Path | str]) -> Calibration:
    """Calibrate from several past runs of the spec's model at once: the medians over all
    their merged units, and over the runs for the epoch closes (each run's first close
    is its own). The units of one run agree closely (their per-example CPU within ~10%
    here); what moves a calibration is the run, by ~30% from one run to the next on a
    shared machine (docs/planner.md): several runs pool that out, more rows of one do not."""
    if len(paths) == 1:
        return read_calibration(paths[0])
    if not paths:
        raise CalibrationError("no run to calibrate from")
    rows: list[dict[str, str]] = []
    evals: list[tuple[float, float]] = []
    for i, path in enumerate(paths):
        p = units_csv_path(path)
        # Tagged with their run: concurrency is counted within one run.
        rows += ({**r, "_run": str(i)} for r in itertools.islice(_rows(p), MAX_ROWS - len(rows)))
        evals.append(_epoch_evals(p.parent / "epochs.csv"))
    timed = [e for e in evals if e != (0.0, 0.0)] or [(0.0, 0.0)]
    return calibration_from_rows(rows, f"{len(paths)} runs ({', '.join(str(x) for x in paths)})",
                                 statistics.median(e[0] for e in timed), statistics.median(e[1] for e in timed))


def read_unit_rows(path: Path | str) -> list[dict[str, str]]:
    """The rows of a run directory's (or a path's) ``units.csv``, checked as
    :func:`read_calibration` checks them (at most ``MAX_ROWS``)."""
    return list(itertools.islice(_rows(units_csv_path(path)), MAX_ROWS))


def calibration_from_rows(rows: Iterable[Mapping[str, Any]], source: str, eval_s: float = 0.0,
                          first_eval_extra_s: float = 0.0) -> Calibration:
    """Calibrate from a job's per-unit merge records: the rows of its ``units.csv``
    (strings), or the same records read from the job's store (numbers; a BOINC job's,
    ``server.run.outputs.collect_history``). ``eval_s`` and ``first_eval_extra_s`` are
    the epoch closes' evaluation (:func:`epoch_evals`). At most ``MAX_ROWS`` rows are read.

    The per-unit costs come from the units that ran alone (mean concurrency under
    ``ALONE_BELOW``: a 1-slot run's), where there are at least three; the units that ran
    beside others then calibrate the contention term (:mod:`.contention`). Rows may carry
    ``_run`` (which pooled run they came from): concurrency is counted within a run and
    a host only."""
    units = [u for u in (_unit(r) for r in itertools.islice(rows, MAX_ROWS)) if u is not None]
    if not units:
        raise CalibrationError(f"{source}: no merged unit with recorded train_s and wall_s: nothing to calibrate from")
    _set_concurrency(units)
    alone = [u for u in units if u.running is not None and u.running < ALONE_BELOW]
    base = alone if len(alone) >= MIN_CROWDED else units
    per_ex = [u.per_ex for u in base if u.per_ex is not None]
    if not per_ex:
        raise CalibrationError(f"{source}: no merged unit says how many examples it trained on (examples_seen)")
    first = [u.first for u in base if u.first is not None]
    timed = [(u.t_merge, u.wall) for u in base if u.t_merge is not None]
    wall = statistics.median(u.wall for u in base)
    first_extra = max(0.0, min(timed)[1] - wall) if len(timed) > 1 else 0.0
    cal = Calibration(source, len(units), statistics.median(per_ex), statistics.median(u.over for u in base),
                      statistics.median(u.train for u in base), wall,
                      statistics.median(u.examples for u in base if u.examples),
                      _median([u.merge for u in base if u.merge is not None]),
                      _median([u.commit for u in base if u.commit is not None]),
                      _median([u.validate for u in base if u.validate is not None]),
                      sum(u.cpu is not None for u in units) * 2 > len(units),
                      statistics.median(first) if len(first) * 2 > len(base) else 0.0,
                      first_extra, eval_s, first_eval_extra_s)
    return replace(cal, contention=_fit(cal, units, base is alone))


@dataclass
class _Unit:
    """One merged unit's numbers, as the calibration uses them."""

    train: float
    wall: float
    over: float  # CPU (else wall) seconds outside the training steps
    per_ex: float | None  # training CPU (else wall) seconds per example, the first step apart
    examples: float | None
    first: float | None  # CPU of the first training step
    cpu: float | None  # CPU seconds of the whole unit (at most its wall time)
    merge: float | None
    validate: float | None
    commit: float | None
    t_merge: float | None  # when it merged (a Unix time)
    end_lag: float  # validation + merge wall time: the client finished this long before t_merge
    group: tuple[str, str]  # (run, host): concurrency is counted within one
    running: float | None = None  # units running at once during it, time-averaged (itself included)


def _unit(row: Mapping[str, Any]) -> _Unit | None:
    """A merged unit of a row, or None (a failed unit, no durations)."""
    if row.get("failed"):
        return None
    g = {k: _float(row.get(k)) for k in ("train_s", "wall_s", "train_cpu_s", "cpu_s", "examples_seen",
                                         "validate_s", "validate_cpu_s", "merge_s", "merge_cpu_s", "commit_s",
                                         "first_step_cpu_s")}
    if g["train_s"] is None or g["wall_s"] is None or g["wall_s"] < g["train_s"]:
        return None
    ex = g["examples_seen"]
    first = cpu = None
    # CPU seconds where recorded (they do not stretch when cores are shared), never
    # more than the wall time they were measured in (a multi-threaded slot).
    if g["train_cpu_s"] is not None and g["cpu_s"] is not None:
        t = min(g["train_cpu_s"], g["train_s"]) if g["train_cpu_s"] > 0 else g["train_s"]
        f0 = g["first_step_cpu_s"]
        if f0 is not None and 0 < f0 <= t:  # the first step apart: per unit, not per example
            first = f0
            t -= f0
        over = max(0.0, min(g["cpu_s"], g["wall_s"]) - min(g["train_cpu_s"], g["cpu_s"]))
        cpu = min(g["cpu_s"], g["wall_s"])
    else:
        t = g["train_s"]
        over = g["wall_s"] - g["train_s"]
    v = g["validate_cpu_s"] if g["validate_cpu_s"] is not None else g["validate_s"]
    m = g["merge_cpu_s"]
    if m is None and g["merge_s"] is not None:  # wall time: its Redis waits are commit_s's
        m = max(0.0, g["merge_s"] - (g["commit_s"] or 0.0))
    both = v is not None and m is not None
    return _Unit(g["train_s"], g["wall_s"], over, t / ex if ex else None, ex or None, first, cpu,
                 (v or 0.0) + (m or 0.0) if both else None, v if both else None, g["commit_s"],
                 _float(row.get("t"), 1e12), (g["validate_s"] or 0.0) + (g["merge_s"] or 0.0),
                 (str(row.get("_run", "")), str(row.get("host", ""))[:200]))


def _set_concurrency(units: list[_Unit]) -> None:
    """Each unit's time-averaged count of units running at once, within its run and host:
    its client interval is the wall time that ended when its validation began."""
    groups: dict[tuple[str, str], list[_Unit]] = {}
    for u in units:
        groups.setdefault(u.group, []).append(u)
    for us in groups.values():
        ivs = [(u.t_merge - u.end_lag - u.wall, u.t_merge - u.end_lag) if u.t_merge is not None else None
               for u in us]
        for u, k in zip(us, mean_concurrency(ivs), strict=True):
            u.running = k


def _fit(cal: Calibration, units: list[_Unit], from_alone: bool) -> Contention:
    """The contention term: each crowded unit's CPU against what its size costs alone.
    A slot's first unit (it traces the model: a first step ~5x the others') is left out."""
    if not from_alone:
        return Contention(note="no units that ran alone to compare with (calibrate from a 1-slot run "
                               "too): contention not modelled (g = 0)")
    typical_first = cal.first_step_s or None
    samples = []
    for u in units:
        if u.running is None or u.cpu is None or u.examples is None:
            continue
        if typical_first and u.first is not None and u.first > 2.5 * typical_first:
            continue
        alone = cal.unit_compute_s(u.examples) + cal.overhead_s
        if alone > 0:
            samples.append((u.running, u.cpu / alone))
    return fit_contention(samples)


def _epoch_evals(p: Path) -> tuple[float, float]:
    """:func:`epoch_evals` of the run's ``epochs.csv`` beside its units.csv; (0, 0) without it."""
    if not p.is_file() or p.stat().st_size > MAX_BYTES:
        return 0.0, 0.0
    try:
        with p.open(newline="", encoding="utf-8") as f:
            return epoch_evals(list(itertools.islice(csv.DictReader(f), MAX_ROWS)))
    except (OSError, UnicodeDecodeError, csv.Error):
        return 0.0, 0.0


def epoch_evals(rows: Iterable[Mapping[str, Any]]) -> tuple[float, float]:
    """(median evaluation at an epoch's close, the first one's extra) from a job's epoch
    records (``epochs.csv``'s rows, or the store's; the generator's own clock); (0, 0)
    when none recorded one."""
    evals = [x for x in (_float(r.get("eval_s")) for r in itertools.islice(rows, MAX_ROWS)) if x is not None]
    if not evals:
        return 0.0, 0.0
    rest = statistics.median(evals[1:]) if len(evals) > 1 else evals[0]
    return rest, max(0.0, evals[0] - rest)
