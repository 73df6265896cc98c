"""Defaults derived from the data and the slots (server/common/spec_defaults.py) and the
run-directory lock (server/common/filelock.py). The runs that use them are in
tests/test_first_hour.py; how well the defaults learn is bench/bench_learning.py's."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from boinc_dl.server.common.filelock import FileLock, LockBusy
from boinc_dl.server.common.spec import parse_spec, spec_from_json, spec_to_json
from boinc_dl.server.common.spec_defaults import derive, fill_from, missing

MINIMAL = {"name": "j", "mode": "vcasgd", "model": "m:build", "dataset": {"name": "digits"}, "training": {"epochs": 5}}


def spec(**sections):
    data = {**MINIMAL}
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) else v
    return parse_spec(data)


@pytest.mark.parametrize(("n_train", "slots", "subsets", "window", "local_epochs", "rule"), [
    (800, 8, 8, None, 8, "delta"),       # the user: one subset per slot, a local epoch per unit in flight
    (1437, 8, 8, None, 8, "delta"),      # digits
    (60000, 8, 8, None, 8, "delta"),     # MNIST: 7,500 examples a subset
    (100000, 8, 16, None, 8, "delta"),   # past 10,000 examples a subset: two rounds of the slots
    (200, 8, 3, 3, 4, "delta"),          # at least 64 examples a subset, as many in flight
    (30, 8, 1, 1, 4, "delta"),
    (1437, 2, 2, None, 4, "delta"),      # a small machine: at least 4 local epochs
    (1437, 1, 1, None, 4, "delta"),
    (100000, 31, 31, None, 16, "delta"),   # below 32 in flight: no search
    (100000, 32, 32, None, 16, "search"),  # a large fleet: at most 16 local epochs, the step search
    (60000, 1000, 937, 937, 16, "search"),  # 1,000 hosts on MNIST: 64 examples a subset, 937 in flight
])
def test_derived_values(n_train: int, slots: int, subsets: int, window: int | None, local_epochs: int,
                        rule: str) -> None:
    s = spec()
    assert missing(s) == ["vcasgd.n_subsets", "vcasgd.merge_rule", "training.local_epochs"]
    d, chosen = derive(s, n_train, slots)
    assert (d.vcasgd.n_subsets, d.vcasgd.window, d.training.local_epochs, d.vcasgd.merge_rule) == \
        (subsets, window, local_epochs, rule)
    assert [c.field for c in chosen] == ["vcasgd.n_subsets", *(["vcasgd.window"] if window else []),
                                         "training.local_epochs", "vcasgd.merge_rule"]
    assert all(c.why for c in chosen) and not missing(d)
    assert spec_from_json(spec_to_json(d)) == d  # what the store keeps, the daemons read back


def test_too_few_examples_for_a_subset_per_slot_keep_as_many_units_in_flight_as_subsets() -> None:
    """455 examples on 32 slots: 7 subsets, and 7 in flight, not 32: with 32 the job's three
    epochs were all issued from its initial weights (0.912 after each of them)."""
    d, chosen = derive(spec(), 455, 32)
    assert (d.vcasgd.n_subsets, d.vcasgd.window, d.training.local_epochs, d.vcasgd.merge_rule) == \
        (7, 7, 7, "delta")
    why = {c.field: c.why for c in chosen}["vcasgd.window"]
    assert "7 subsets per epoch on 32 slots" in why
    # a window or subsets the user gives stay theirs (D = 4x the subsets is theirs to choose)
    assert derive(spec(vcasgd={"window": 32}), 455, 32)[0].vcasgd.window == 32
    assert derive(spec(vcasgd={"n_subsets": 7}), 455, 32)[0].vcasgd.window is None
    # a resumed job keeps the window derived with its subsets
    assert fill_from(spec(), d).vcasgd.window == 7
    assert fill_from(spec(), derive(spec(), 1437, 8)[0]).vcasgd.window is None


def test_window_sets_units_in_flight_and_given_values_stay() -> None:
    d, _ = derive(spec(vcasgd={"window": 4}), 1437, 8)
    assert (d.vcasgd.n_subsets, d.training.local_epochs, d.vcasgd.merge_rule) == (4, 4, "delta")
    d, _ = derive(spec(vcasgd={"window": 64}), 1437, 8)
    assert d.vcasgd.merge_rule == "search"
    given = spec(vcasgd={"n_subsets": 5, "merge_rule": "paper"}, training={"epochs": 5, "local_epochs": 2})
    d, chosen = derive(given, 1437, 64)
    assert (d.vcasgd.n_subsets, d.training.local_epochs, d.vcasgd.merge_rule, chosen) == (5, 2, "paper", [])


def test_a_job_stored_before_the_rule_was_derived_resumes_with_delta() -> None:
    stored = spec(vcasgd={"n_subsets": 8}, training={"epochs": 5, "local_epochs": 8})
    assert stored.vcasgd.merge_rule is None  # what such a job's stored spec holds
    assert fill_from(spec(), stored).vcasgd.merge_rule == "delta"


def test_mop_trains_one_local_epoch_and_resumes_keep_the_derived_values() -> None:
    mop = spec(mode="mop", mop={"param_grid": {"learning_rate": [0.01, 0.001]}})
    d, chosen = derive(mop, 1437, 8)
    assert d.training.local_epochs == 1 and [c.field for c in chosen] == ["training.local_epochs"]
    first, _ = derive(spec(), 1437, 8)
    # A resumed run (other --workers) takes what the job derived first, not a new choice.
    assert fill_from(spec(), first) == first


def _holder(path: Path) -> subprocess.Popen[str]:
    code = ("import sys, time\nfrom boinc_dl.server.common.filelock import FileLock\n"
            f"FileLock({str(path)!r}, 'boinc-dl run of j').acquire()\nprint('held', flush=True)\ntime.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_lock_is_exclusive_and_freed_by_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "run" / "run.lock"
    holder = _holder(path)
    try:
        with pytest.raises(LockBusy, match=r"in use by another boinc-dl run of j \(pid \d+, started"):
            FileLock(path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    t0 = time.monotonic()
    with FileLock(path, "test") as lock:  # the kernel dropped the dead holder's lock
        assert lock.fd is not None and time.monotonic() - t0 < 1.0
        with pytest.raises(LockBusy):
            FileLock(path).acquire()  # one holder per lock, in one process too
    FileLock(path).acquire().release()
