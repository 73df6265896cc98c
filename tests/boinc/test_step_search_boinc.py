"""``merge_rule: search`` on the user's path: a BOINC project (the fake one, its database in
MariaDB), the work generator daemon run as BOINC runs it, its checker thread choosing each
result's step with TensorFlow, results handed to the assimilator shim as
``script_assimilator`` does, and the daemon SIGKILLed while results wait for their steps."""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest

from boinc_dl.server.assimilator import policy, rules
from tests.boinc.test_loss_check_boinc import Play

pytestmark = pytest.mark.slow


@pytest.fixture
def play(db_project, redis_server, tmp_path):
    pl = Play(db_project, redis_server.url, f"digits-search-{os.urandom(3).hex()}", tmp_path,
              {"loss_check": False}, {"merge_rule": "search", "search_batch": 512})
    yield pl
    pl.stop()


def test_each_result_gets_its_searched_step_through_a_daemon_sigkill(play: Play) -> None:
    store = play.store
    play.start()
    play.wait_checker()
    wus = play.new_workunits(8)
    # honest results of different sizes: some overshoot from where the server is by then
    uploads = [play.upload(wu, play.weights_for(wu["name"], "honest", i, share=(0.3, 1.0, 0.05, 2.0)[i % 4]),
                           trusted=True) for i, wu in enumerate(wus)]
    first = [play.assimilate(wu, paths) for wu, paths in zip(wus[:4], uploads[:4], strict=True)]
    assert [p.wait(120) for p in first] == [0, 0, 0, 0], [p.stdout.read() for p in first]
    rest = [play.assimilate(wu, paths) for wu, paths in zip(wus[4:], uploads[4:], strict=True)]
    deadline = time.monotonic() + 60
    while not store.loss_pending_count():  # a step request is queued
        assert time.monotonic() < deadline
        time.sleep(0.005)
    time.sleep(random.uniform(0.0, 0.05))
    play.kill()
    codes = [p.wait(120) for p in rest]
    assert set(codes) <= {0, 3}, [p.stdout.read() for p in rest]
    play.start()
    play.wait_checker()
    for wu, paths, code in zip(wus[4:], uploads[4:], codes, strict=True):
        if code == 3:  # a transient exit: BOINC hands the result over again
            play.assimilate_until_handled(wu, paths)
    merged = store.assimilated()
    names = [wu["name"] for wu in wus]
    assert all(n in merged for n in names)
    merges = [m["unit"] for m in store.metrics("merge")]
    assert sorted(merges) == sorted(names) and store.version("0") == 8  # each once
    for n in names:
        rec = merged[n]
        assert rec["merge_rule"].startswith("search(step ") and 0.0 <= rec["step"] <= 1.0, rec["merge_rule"]
        # its candidates as the product bounds them: delta's weight capped by the window the
        # generator recorded with the unit (BOINC's live capacity may have set it below the
        # spec's), the steps by the units issued from the result's base version
        info = store.unit_info(Play.unit_of(n))
        k = policy.in_flight_of(info)
        w = rules.MergeRule("delta", staleness=rules.Staleness("poly", p=1.0), server_lr=1.0,
                            cap_in_flight=True).capped(k).weight(rec["staleness"])
        steps = rules.search_steps(w, store.issued_from("0", rec["base_version"]) or 1, k)
        # one of its candidates, chosen by the daemon's forward passes (losses recorded), or,
        # for a result that waited longer than search_wait_s across the kill, delta's weight
        assert any(np.isclose(rec["step"], c) for c in steps), (rec, info, steps)
        if rec["step_fallback"]:
            assert np.isclose(rec["step"], w) and n in names[4:]
        else:
            assert rec["step_losses"] and rec["step_losses"][0] is not None
    # the searched steps differ: the search chose, it did not just apply delta's weight
    assert len({round(merged[n]["step"], 6) for n in names}) > 1
    assert not any(merged[n]["step_fallback"] for n in names[:4])  # the daemon was up for these
    assert store.loss_pending_count() == 0
