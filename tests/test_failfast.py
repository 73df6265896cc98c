"""The fail-fast policy: a job whose first units all fail the same way ends failed."""

from __future__ import annotations

from boinc_dl.server.run.failfast import FailFast, error_key


def test_same_error_on_k_units_fails_the_job() -> None:
    ff = FailFast(k=3)
    ff.failure("j_e1_s0", "client error: ValueError: loss is NaN at batch 3")
    ff.failure("j_e1_s0", "client error: ValueError: loss is NaN at batch 4")  # same unit again
    ff.failure("j_e1_s1", "client error: ValueError: loss is NaN at batch 12")
    assert ff.verdict() is None  # two units only
    ff.failure("j_e1_s2", "client error: ValueError: loss is NaN at batch 7")
    v = ff.verdict()
    assert v is not None and "first 3 units" in v and "loss is NaN at batch 3" in v  # the first error, verbatim


def test_mixed_errors_need_twice_the_evidence() -> None:
    ff = FailFast(k=2)
    for i, err in enumerate(["OOM", "segfault", "OOM"]):
        ff.failure(f"u{i}", err)
    assert ff.verdict() is None
    ff.failure("u3", "disk full")
    assert ff.verdict() is not None and "first error: OOM" in ff.verdict()


def test_one_merge_turns_the_policy_off() -> None:
    ff = FailFast(k=1)
    ff.success()
    for i in range(10):
        ff.failure(f"u{i}", "boom")
    assert ff.verdict() is None


def test_error_key_masks_numbers_only() -> None:
    assert error_key("unit 12 at 0x7f3a: shape (3, 4)") == error_key("unit 7 at 0x11: shape (5, 6)")
    assert error_key("ValueError: x") != error_key("TypeError: x")


def test_slots_dying_at_start_fail_only_when_every_slot_does() -> None:
    """``start_failure``: every slot has died before it was ready 3 times in a row; one
    slot that started (or has died only twice) keeps the run going."""
    from boinc_dl.server.backends.local.slots import SlotPool, _Slot

    pool = SlotPool.__new__(SlotPool)
    pool.slots = [_Slot(host=0, index=i, fast_deaths=3, last_exit=1) for i in range(2)]
    assert pool.start_failure() == "every slot died at start, 3 times in a row or more (exit 1)"
    pool.slots[1].fast_deaths = 2
    assert pool.start_failure() is None
    pool.slots[1].fast_deaths, pool.slots[1].started = 5, True
    assert pool.start_failure() is None
    pool.slots = []
    assert pool.start_failure() is None
