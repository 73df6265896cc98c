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
  generator's evaluation when it closes an epoch (``eval_s``) and the first one's extra.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boinc_dl.server.planner.boinc_times import BoincTimes

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
                f"({'CPU' if self.cpu_clock else 'wall'} time; median unit wall {self.wall_s:.3f} s as run); {srv}{ev}")


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
    for path in paths:
        p = units_csv_path(path)
        rows += itertools.islice(_rows(p), MAX_ROWS - len(rows))
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
    the epoch closes' evaluation (:func:`epoch_evals`). At most ``MAX_ROWS`` rows are read."""
    per_ex, over, train, wall, examples = [], [], [], [], []
    merge, commit, validate, first = [], [], [], []
    timed: list[tuple[float, float]] = []  # (merge time, unit wall) to find the first unit
    cpu_rows = 0
    for row in itertools.islice(rows, MAX_ROWS):
        if row.get("failed"):
            continue
        g = {k: _float(row.get(k)) for k in ("train_s", "wall_s", "train_cpu_s", "cpu_s", "examples_seen",
                                             "validate_s", "validate_cpu_s", "merge_s", "merge_cpu_s", "commit_s",
                                             "first_step_cpu_s")}
        if g["train_s"] is None or g["wall_s"] is None or g["wall_s"] < g["train_s"]:
            continue
        train.append(g["train_s"])
        wall.append(g["wall_s"])
        t_merge = _float(row.get("t"), 1e12)  # a Unix time
        if t_merge is not None:
            timed.append((t_merge, g["wall_s"]))
        ex = g["examples_seen"]
        # CPU seconds where recorded (they do not stretch when cores are shared), never
        # more than the wall time they were measured in (a multi-threaded slot).
        if g["train_cpu_s"] is not None and g["cpu_s"] is not None:
            cpu_rows += 1
            t = min(g["train_cpu_s"], g["train_s"]) if g["train_cpu_s"] > 0 else g["train_s"]
            f0 = g["first_step_cpu_s"]
            if f0 is not None and 0 < f0 <= t:  # the first step apart: per unit, not per example
                first.append(f0)
                t -= f0
            over.append(max(0.0, min(g["cpu_s"], g["wall_s"]) - min(g["train_cpu_s"], g["cpu_s"])))
        else:
            t = g["train_s"]
            over.append(g["wall_s"] - g["train_s"])
        if ex:
            per_ex.append(t / ex)
            examples.append(ex)
        v = g["validate_cpu_s"] if g["validate_cpu_s"] is not None else g["validate_s"]
        m = g["merge_cpu_s"]
        if m is None and g["merge_s"] is not None:  # wall time: its Redis waits are commit_s's
            m = max(0.0, g["merge_s"] - (g["commit_s"] or 0.0))
        if v is not None and m is not None:
            validate.append(v)
            merge.append(v + m)
        if g["commit_s"] is not None:
            commit.append(g["commit_s"])
    if not train:
        raise CalibrationError(f"{source}: no merged unit with recorded train_s and wall_s: nothing to calibrate from")
    if not per_ex:
        raise CalibrationError(f"{source}: no merged unit says how many examples it trained on (examples_seen)")
    first_extra = max(0.0, min(timed)[1] - statistics.median(wall)) if len(timed) > 1 else 0.0
    return Calibration(source, len(train), statistics.median(per_ex), statistics.median(over),
                       statistics.median(train), statistics.median(wall), statistics.median(examples),
                       _median(merge), _median(commit), _median(validate), cpu_rows * 2 > len(train),
                       statistics.median(first) if len(first) * 2 > len(train) else 0.0,
                       first_extra, eval_s, first_eval_extra_s)


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
