"""Merge rules and defences (server/assimilator/rules.py): numpy only, no Redis, no TF."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from boinc_dl.server.assimilator import rules as R
from boinc_dl.server.assimilator.core import merge_into
from tests.support import baselines as norms

F = np.float32


def vec(*xs: float) -> np.ndarray:
    return np.array(xs, dtype=F)


# ---- staleness ------------------------------------------------------------------------------
def test_staleness_functions() -> None:
    assert R.Staleness().weight(100) == 1.0
    poly = R.Staleness("poly", p=0.5)
    assert poly.weight(0) == 1.0
    assert poly.weight(3) == pytest.approx(0.5)  # (1+3)^-0.5
    assert poly.weight(-5) == 1.0  # a negative staleness (clock skew) counts as fresh
    hinge = R.Staleness("hinge", a=10, b=4)
    assert hinge.weight(4) == 1.0
    assert hinge.weight(6) == pytest.approx(1 / 21)  # 1/(10*(6-4)+1)
    with pytest.raises(ValueError):
        R.Staleness("exp")


# ---- each rule against a hand-computed case ---------------------------------------------------------------
def test_paper_is_the_assimilators_merge_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    ws, wc = rng.normal(size=1000).astype(F), rng.normal(size=1000).astype(F)
    want = merge_into(ws.copy(), wc, 0.7)
    got = R.MergeRule("paper", 0.7).apply(ws.copy(), wc, None, s=50)
    assert np.array_equal(got, want)  # staleness is ignored by the paper's rule
    assert np.allclose(R.MergeRule("paper", 0.5).apply(vec(2, 4), vec(0, 8), None, 0), [1, 6])


def test_fedasync_shrinks_the_mixing_weight_with_staleness() -> None:
    rule = R.MergeRule("fedasync", 0.5, R.Staleness("poly", p=1.0))
    # beta = (1-0.5) * 1/(1+3) = 0.125: ws + 0.125*(wc - ws)
    assert np.allclose(rule.apply(vec(0, 8), vec(8, 0), None, s=3), [1, 7])
    assert np.allclose(rule.apply(vec(0, 8), vec(8, 0), None, s=0), [4, 4])


def test_delta_applies_the_clients_progress_from_its_base() -> None:
    rule = R.MergeRule("delta", server_lr=1.0, staleness=R.Staleness("poly", p=1.0))
    ws, wb, wc = vec(10, 10), vec(1, 2), vec(3, 0)  # d = wc - wb = (2, -2)
    # s = 1: ws + 1 * 1/2 * (2, -2)
    assert np.allclose(rule.apply(ws, wc, wb, s=1), [11, 9])
    # the naive delta merge: lr = 1 - a, no staleness weight
    naive = R.MergeRule("delta", 0.5, server_lr=0.5)
    assert np.allclose(naive.apply(vec(10, 10), wc, wb, s=100), [11, 9])
    with pytest.raises(ValueError, match="base"):
        naive.apply(vec(10, 10), wc, None, 0)


def test_capped_delta_bounds_what_a_round_from_one_base_adds() -> None:
    """k units from one base: uncapped, their deltas add up to H(k) times one step (2.7 at
    k = 8); capped at CAP_SHARE/k, to at most CAP_SHARE steps (1.6 at k = 8). With the
    same delta from each, the step taken is the sum of the weights, exactly."""
    k = 8
    rng = np.random.default_rng(3)
    wb = rng.normal(size=32).astype(F)
    d = rng.normal(size=32).astype(F)
    rule = R.MergeRule("delta", staleness=R.Staleness("poly", p=1.0), server_lr=1.0, cap_in_flight=True)
    capped = rule.capped(k)
    assert R.CAP_SHARE == 2.0 and capped.max_weight == pytest.approx(2 / k)
    assert [capped.weight(s) for s in (0, 3, 4, 7)] == pytest.approx([1 / 4, 1 / 4, 1 / 5, 1 / 8])

    def round_step(r: R.MergeRule) -> float:
        ws = wb.copy()
        for s in range(k):
            r.apply(ws, wb + d, wb, s)
        return float(np.linalg.norm(ws - wb) / np.linalg.norm(d))

    assert round_step(capped) == pytest.approx(sum(min(0.25, 1 / (1 + s)) for s in range(k)), rel=1e-5)
    assert round_step(capped) < 1.7 < 2.7 < round_step(rule)  # cap_in_flight acts only through capped()
    # two or fewer in flight, or a rule that does not cap: unchanged
    assert rule.capped(2) is rule and rule.capped(1) is rule and R.MergeRule("delta").capped(8).max_weight == 1.0
    assert "cap 0.25" in capped.describe() and "cap" not in rule.describe()
    with pytest.raises(ValueError, match="max_weight"):
        R.MergeRule("delta", max_weight=0.0)


def test_a_capped_merge_replays_bit_for_bit_and_an_old_record_replays_uncapped() -> None:
    from boinc_dl.server.assimilator.policy import REPLAYABLE

    rng = np.random.default_rng(4)
    ws, wc = rng.normal(size=16).astype(F), rng.normal(size=16).astype(F)
    rec = {"name": "fedasync", "alpha": 0.0, "server_lr": 1.0,
           "staleness": {"kind": "poly", "p": 1.0, "a": 10.0, "b": 4.0}}
    params = {"rule": {**rec, "max_weight": 0.25}, "s": 0, "scale": 1.0, "base": None}
    live = R.MergeRule("fedasync", 0.0, R.Staleness("poly", p=1.0), max_weight=0.25).apply(ws.copy(), wc, None, 0)
    assert np.array_equal(R.apply(REPLAYABLE, ws.copy(), wc, params, slice(0, 16)), live)
    old = {"rule": rec, "s": 0, "scale": 1.0, "base": None}  # written before the cap: full weight
    assert np.array_equal(R.apply(REPLAYABLE, ws.copy(), wc, old, slice(0, 16)), wc)


def test_delta_at_staleness_zero_with_lr_one_minus_a_is_the_paper() -> None:
    rng = np.random.default_rng(1)
    ws, wc = rng.normal(size=64).astype(F), rng.normal(size=64).astype(F)
    paper = R.MergeRule("paper", 0.5).apply(ws.copy(), wc, None, 0)
    delta = R.MergeRule("delta", 0.5, server_lr=0.5).apply(ws.copy(), wc, ws.copy(), 0)
    assert np.allclose(paper, delta, atol=1e-6)


def test_fedbuff_buffers_k_deltas_then_applies_their_mean() -> None:
    rule = R.MergeRule("fedbuff", server_lr=2.0, buffer_k=2)
    st = rule.new_state(2)
    ws = vec(0, 0)
    rule.apply(ws, vec(1, 1), vec(0, 0), 0, st)  # d1 = (1, 1): buffered, ws unchanged
    assert np.array_equal(ws, [0, 0]) and st.count == 1 and np.allclose(st.buf, [1, 1])
    rule.apply(ws, vec(3, -1), vec(0, 0), 0, st)  # d2 = (3, -1): flush 2 * mean = (4, 0)
    assert np.allclose(ws, [4, 0]) and st.count == 0 and np.array_equal(st.buf, [0, 0]) and st.steps == 1


def test_fedbuff_weights_each_delta_by_its_staleness() -> None:
    rule = R.MergeRule("fedbuff", server_lr=1.0, buffer_k=2, staleness=R.Staleness("poly", p=1.0))
    st = rule.new_state(1)
    ws = vec(0)
    rule.apply(ws, vec(4), vec(0), 0, st)  # weight 1
    rule.apply(ws, vec(4), vec(0), 3, st)  # weight 1/4
    assert np.allclose(ws, [(4 + 1) / 2])


def test_server_momentum() -> None:
    rule = R.MergeRule("momentum", server_lr=0.5, momentum=0.9)
    st = rule.new_state(1)
    ws = vec(0)
    rule.apply(ws, vec(2), vec(0), 0, st)  # m = 2, ws = 1
    assert np.allclose(st.mom, [2]) and np.allclose(ws, [1])
    rule.apply(ws, vec(2), vec(0), 0, st)  # m = 0.9*2 + 2 = 3.8, ws = 1 + 1.9
    assert np.allclose(st.mom, [3.8]) and np.allclose(ws, [2.9])
    with pytest.raises(ValueError, match="state"):
        rule.apply(vec(0), vec(1), vec(0), 0, None)


def test_buffered_momentum_steps_at_each_flush() -> None:
    rule = R.MergeRule("momentum", server_lr=1.0, momentum=0.5, buffer_k=2)
    st = rule.new_state(1)
    ws = vec(0)
    for _ in range(2):
        rule.apply(ws, vec(2), vec(0), 0, st)
    assert np.allclose(ws, [2]) and np.allclose(st.mom, [2])  # m = mean(2, 2) = 2
    for _ in range(2):
        rule.apply(ws, vec(2), vec(0), 0, st)
    assert np.allclose(st.mom, [3]) and np.allclose(ws, [5])  # m = 0.5*2 + 2


def test_rule_parameters_are_checked() -> None:
    for bad in ({"name": "median"}, {"alpha": 1.0}, {"server_lr": 0.0}, {"buffer_k": 0}, {"momentum": 1.0},
                {"name": "fedbuff", "momentum": 0.5}):
        with pytest.raises(ValueError):
            R.MergeRule(**bad)  # type: ignore[arg-type]


# ---- float32, in place --------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", [
    R.MergeRule("paper"), R.MergeRule("fedasync", staleness=R.Staleness("poly")),
    R.MergeRule("delta", staleness=R.Staleness("poly", p=1.0), server_lr=1.0),
    R.MergeRule("fedbuff", buffer_k=3), R.MergeRule("momentum", momentum=0.9, buffer_k=2),
])
def test_in_place_and_float32(rule: R.MergeRule) -> None:
    rng = np.random.default_rng(2)
    ws, wc, wb = (rng.normal(size=100).astype(F) for _ in range(3))
    st = rule.new_state(100)
    scratch = np.empty(100, F)
    for clip in (1.0, 0.5):
        out = rule.apply(ws, wc, wb, 4, st, scale=clip, scratch=scratch)
        assert out is ws and ws.dtype == F
        assert st.buf is None or st.buf.dtype == F
        assert st.mom is None or st.mom.dtype == F
    with pytest.raises(TypeError):
        rule.apply(ws.astype(np.float64), wc, wb, 0, st)
    ro = ws.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        rule.apply(ro, wc, wb, 0, st)


def test_no_model_sized_temporaries_beyond_one_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a scratch buffer given, a delta merge allocates no float32 array of shard size."""
    n = 200_000
    ws, wc, wb, scratch = (np.ones(n, F) for _ in range(4))
    rule = R.MergeRule("delta", staleness=R.Staleness("poly", p=1.0), server_lr=1.0)
    import tracemalloc

    tracemalloc.start()
    rule.apply(ws, wc, wb, 3, None, 1.0, scratch)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < n * 4 // 4


# ---- per-shard composition ---------------------------------------------------------------------------
@pytest.mark.parametrize("rule", [
    R.MergeRule("paper", 0.6), R.MergeRule("fedasync", 0.5, R.Staleness("hinge", a=2, b=1)),
    R.MergeRule("delta", staleness=R.Staleness("poly", p=1.0), server_lr=1.0),
    R.MergeRule("fedbuff", staleness=R.Staleness("poly", p=0.5), server_lr=1.5, buffer_k=3),
    R.MergeRule("momentum", staleness=R.Staleness("poly", p=1.0), server_lr=0.3, momentum=0.8, buffer_k=2),
])
@pytest.mark.parametrize("clip", [1.0, 0.3])
def test_shard_by_shard_equals_whole_model(rule: R.MergeRule, clip: float) -> None:
    rng = np.random.default_rng(3)
    n = 1001
    whole = rng.normal(size=n).astype(F)
    sharded = whole.copy()
    st_whole = [rule.new_state(n)]
    bounds = list(R.iter_bounds(n, 7))
    st_shards = [rule.new_state(sl.stop - sl.start) for sl in bounds]
    for step in range(7):  # a sequence of results, staleness varying, through two flushes
        wc, wb = rng.normal(size=n).astype(F), rng.normal(size=n).astype(F)
        R.apply_model(rule, whole, wc, wb, step % 4, [slice(0, n)], st_whole, clip)
        R.apply_model(rule, sharded, wc, wb, step % 4, bounds, st_shards, clip)
        assert np.array_equal(whole, sharded)
    if rule.needs_buffer:
        assert np.array_equal(st_whole[0].buf, np.concatenate([s.buf for s in st_shards]))
    if rule.needs_momentum:
        assert np.array_equal(st_whole[0].mom, np.concatenate([s.mom for s in st_shards]))


# ---- clipping -----------------------------------------------------------------------------------------
def test_clip_scale_and_clipped_merge() -> None:
    assert R.clip_scale(5.0, None) == 1.0
    assert R.clip_scale(5.0, 10.0) == 1.0
    assert R.clip_scale(5.0, 2.0) == pytest.approx(0.4)
    assert R.clip_scale(math.inf, 2.0) == 0.0
    assert R.clip_scale(math.nan, 2.0) == 0.0
    wb, wc = vec(0, 0), vec(3, 4)  # ||wc - wb|| = 5
    assert R.update_norm(wc, wb) == pytest.approx(5.0)
    s = R.clip_scale(R.update_norm(wc, wb), 1.0)
    # delta: ws + 1 * 0.2 * (3, 4)
    assert np.allclose(R.MergeRule("delta", server_lr=1.0).apply(vec(1, 1), wc, wb, 0, scale=s), [1.6, 1.8])
    # paper: pulls towards wb + clip(wc - wb) = (0.6, 0.8)
    assert np.allclose(R.MergeRule("paper", 0.5).apply(vec(1, 1), wc, wb, 0, scale=s), [0.8, 0.9])
    with pytest.raises(ValueError, match="base"):
        R.MergeRule("paper").apply(vec(1, 1), wc, None, 0, scale=0.5)
    with pytest.raises(ValueError):
        R.MergeRule("paper").apply(vec(1, 1), wc, wb, 0, scale=1.5)


def test_update_norm_is_chunked_float64_and_flags_overflow() -> None:
    big = np.full(3 * (1 << 20) + 5, 0.5, F)
    assert R.update_norm(big, np.zeros_like(big)) == pytest.approx(0.5 * math.sqrt(big.size))
    assert R.update_norm(vec(3e38, 3e38), vec(-3e38, -3e38)) == pytest.approx(math.sqrt(2) * 6e38)
    assert R.update_norm(vec(np.inf), vec(0)) == math.inf


def test_centred_clip() -> None:
    d = R.centred_clip(vec(5, 0), vec(1, 0), 2.0)  # |d - ref| = 4 -> clipped to 2 around ref
    assert np.allclose(d, [3, 0])


# ---- the trusted radius --------------------------------------------------------------------------------
def test_radius_ignores_untrusted_inputs() -> None:
    tr = R.TrustedRadius(factor=2.0, min_samples=4)
    for n in (1.0, 1.2, 0.8, 1.0):
        assert tr.observe(n, True, epoch=1)
    for _ in range(1000):  # a patient attacker's accepted results: never trusted
        assert not tr.observe(50.0, R.trusted_observation(replicated=False, replicas_agree=True), epoch=1)
        assert not tr.observe(50.0, R.trusted_observation(replicated=True, replicas_agree=False), epoch=1)
    assert not tr.observe(math.nan, True, 1)
    assert tr.radius(2) == pytest.approx(2.0)


def test_radius_is_frozen_per_epoch() -> None:
    tr = R.TrustedRadius(factor=2.0, min_samples=3)
    assert tr.radius(1) is None  # nothing trusted yet (no fallback)
    for n in (1.0, 1.0, 1.0):
        tr.observe(n, True, 1)
    r1 = tr.radius(1)  # computed from epoch 1's own first trusted norms, then frozen
    assert r1 == pytest.approx(2.0)
    for _ in range(10):
        tr.observe(5.0, True, 1)  # even trusted observations do not move epoch 1's radius
    assert tr.radius(1) == r1
    assert tr.radius(2) == pytest.approx(10.0)  # median of epoch <= 1 norms (5.0) x 2
    tr.observe(100.0, True, 2)
    assert tr.radius(2) == pytest.approx(10.0)
    again = R.TrustedRadius.from_dict(tr.to_dict(), factor=2.0, min_samples=3)
    assert again.radius(1) == r1 and again.radius(2) == tr.radius(2)


def test_cosine_threshold_follows_trusted_cosines_only() -> None:
    th = R.cosine_threshold(k=3.0, offset=0.0, fallback=0.3, min_samples=4)
    assert th.value(1) == 0.3  # fallback before any trusted cosine
    for c in (-0.5, -0.4, -0.6, -0.5, -0.45, -0.55):
        th.observe(c, True, 1)
    for _ in range(100):
        th.observe(0.9, False, 1)  # an attacker's accepted cosines: ignored
    # median -0.5, MAD 0.05: -0.5 + 3 * 1.4826 * 0.05
    assert th.value(2) == pytest.approx(-0.5 + 3 * 1.4826 * 0.05)
    chk = R.DescentCheck()
    assert chk.passes(-0.4, th.value(2)) and not chk.passes(0.01, th.value(2))
    assert chk.passes(0.0, th.value(2))  # a first-order descent direction is never refused


def test_today_bound_is_moved_by_a_patient_attacker_the_trusted_radius_is_not() -> None:
    """The contrast the issue measured: norms.py's window takes the attacker's own accepted
    distances and ratchets up; the trusted radius does not move."""
    honest = list(np.random.default_rng(4).uniform(0.5, 0.7, 20))
    window = honest[:]
    tr = R.TrustedRadius(factor=2.0, min_samples=8)
    for i, n in enumerate(honest):
        tr.observe(n, True, 1 + i // 5)
    first = norms.adaptive_bound(window, 10.0, 10)
    r = tr.radius(5)
    assert first is not None and r is not None
    for _ in range(40):
        b = norms.adaptive_bound(window[-256:], 10.0, 10)
        window.append(0.99 * b)  # accepted: into today's window
        tr.observe(0.99 * b, R.trusted_observation(False, True), 5)
    assert norms.adaptive_bound(window[-256:], 10.0, 10) > 2 * first
    assert tr.radius(5) == r and tr.radius(6) == r


# ---- descent check -----------------------------------------------------------------------------------
def test_descent_cosine_and_check() -> None:
    g = vec(1, 0)
    assert R.descent_cosine(g, vec(-2, 0)) == pytest.approx(-1.0)
    assert R.descent_cosine(g, vec(0, 3)) == pytest.approx(0.0)
    assert R.descent_cosine_parts(g, vec(1, 1), vec(0, 0)) == pytest.approx(math.sqrt(0.5))
    assert R.descent_cosine(g, vec(0, 0)) == 0.0
    assert R.descent_cosine(g, vec(np.nan, 0)) == math.inf
    chk = R.DescentCheck(max_cosine=0.05)
    assert chk.passes(-0.3) and chk.passes(0.05) and not chk.passes(0.2) and not chk.passes(math.inf)
    assert R.zeno_score(1.0, 0.8, 4.0, 0.01) == pytest.approx(0.16)


# ---- host reputation ---------------------------------------------------------------------------------
def test_reputation_like_boincs_adaptive_replication() -> None:
    rep = R.HostReputation(threshold=3)
    rng = random.Random(0)
    assert rep.needs_replication("h1", rng)  # a new host: replicated
    rep.record("h1", valid=True, replicated=False)  # an unreplicated valid result proves nothing
    assert rep.consecutive_valid("h1") == 0
    for _ in range(3):
        rep.record("h1", valid=True, replicated=True)
    assert rep.trusted("h1")
    # trusted: replicated with probability 1/consecutive_valid (spot checks)
    draws = [rep.needs_replication("h1", rng) for _ in range(3000)]
    assert 0.25 < sum(draws) / len(draws) < 0.42
    rep.record("h1", valid=False, replicated=False)  # an invalid result (failed check): back to 0
    assert rep.consecutive_valid("h1") == 0 and not rep.trusted("h1") and rep.needs_replication("h1", rng)
    for _ in range(5):
        rep.record("h1", True, True)
    rep.record_timeout("h1")
    assert rep.consecutive_valid("h1") == 0
    assert rep.consecutive_valid("h2") == 0 and not rep.trusted("h2")


def test_zeroth_order_loss_check() -> None:
    th = R.loss_increase_threshold(k=6.0, min_samples=4)
    assert th.value(1) is None and R.loss_check_passes(5.0, th.value(1))  # no bound before trusted data
    for d in (-0.02, -0.01, 0.0, -0.03, 0.01, -0.02):
        th.observe(d, True, 1)
    th.observe(3.0, False, 1)  # an unconfirmed result's loss change: ignored
    bound = th.value(1)
    assert bound is not None and bound < 0.2
    assert R.loss_check_passes(-1.0, bound)  # the held-out loss fell: always passes
    assert not R.loss_check_passes(0.5, bound) and not R.loss_check_passes(math.nan, bound)


def test_the_jobs_rule_caps_by_the_units_in_flight_its_record_says() -> None:
    from boinc_dl.server.assimilator.policy import MAX_IN_FLIGHT, in_flight_of, rule_for
    from tests.conftest import tiny_spec

    spec = tiny_spec(vcasgd={"merge_rule": "delta"})
    assert rule_for(spec, 1, in_flight_of({"in_flight": 8})).weight(0) == pytest.approx(2 / 8)
    # records written before the window was kept, or hostile-looking values: no cap, bounded
    for info in ({}, {"in_flight": None}, {"in_flight": "x"}, {"in_flight": -3}, {"in_flight": 0}):
        assert in_flight_of(info) == 1 and rule_for(spec, 1, in_flight_of(info)).weight(0) == 1.0
    assert in_flight_of({"in_flight": 10**12}) == MAX_IN_FLIGHT
    off = tiny_spec(vcasgd={"merge_rule": "delta", "cap_by_in_flight": False})
    assert rule_for(off, 1, 8).weight(0) == 1.0
    # the mixing rules keep their own weights
    assert rule_for(tiny_spec(vcasgd={"merge_rule": "paper"}), 1, 8).max_weight == 1.0
    assert rule_for(tiny_spec(vcasgd={"merge_rule": "fedasync"}), 1, 8).max_weight == 1.0
