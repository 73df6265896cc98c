"""Search spaces and AutoML procedures on synthetic learning curves."""

from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from boinc_dl.server.common.errors import SpecError
from boinc_dl.server.work_generator.mop import (
    PBT,
    Config,
    GridSearch,
    Hyperband,
    RandomSearch,
    SuccessiveHalving,
    grid,
    make_search,
    parse_space,
    sample_configs,
)

SPACE = {
    "lr": {"loguniform": [1e-4, 1e-1]},
    "units": [16, 32, 64, 128],
    "dropout": {"uniform": [0.0, 0.5]},
}


def curve(quality: float, epoch: int) -> float:
    """A synthetic learning curve: rises towards ``quality`` (ranking constant over time)."""
    return quality * (1.0 - math.exp(-epoch / 2.0))


def run(proc, quality, noise=0.0, seed=0):
    """Drive a procedure to the end; returns (decisions, final scores)."""
    rng = random.Random(seed)
    proc.initial()
    decisions, e = [], 0
    while not proc.done:
        e += 1
        res = {
            m: {"val_acc": curve(quality(proc.configs[m]), proc.age[m] + 1) + rng.gauss(0, noise)}
            for m in proc.live
        }
        decisions.append(proc.on_epoch_end(e, res))
        assert e < 1000
    return decisions


# ----------------------------------------------------------------------------- spaces


def test_grid_is_cartesian_product_in_order_with_stable_unique_ids():
    cs = grid({"lr": [0.1, 0.01], "bs": [32, 64, 128], "arch": ["a"]})
    assert [c.params for c in cs][:3] == [
        {"lr": 0.1, "bs": 32, "arch": "a"},
        {"lr": 0.1, "bs": 64, "arch": "a"},
        {"lr": 0.1, "bs": 128, "arch": "a"},
    ]
    assert len(cs) == 6 and len({c.id for c in cs}) == 6
    assert [c.id for c in cs] == [
        c.id for c in grid({"lr": [0.1, 0.01], "bs": [32, 64, 128], "arch": ["a"]})
    ]
    assert Config.from_json(json.loads(json.dumps(cs[0].to_json()))) == cs[0]


@pytest.mark.parametrize(
    "space, message",
    [
        ({}, "empty"),
        ([1, 2], "mapping"),
        ({"lr": []}, "'lr' is an empty list"),
        ({"lr": 0.1}, "'lr' must be a list"),
        ({"lr": [0.1, 0.1]}, "'lr' lists a value twice"),
        ({"lr": [object()]}, "not plain JSON"),
        ({"lr": {"normal": [0, 1]}}, "'lr' must be one of"),
        ({"lr": {"uniform": [1]}}, "two finite numbers"),
        ({"lr": {"uniform": [2, 1]}}, "low < high"),
        ({"lr": {"loguniform": [0, 1]}}, "low > 0"),
        ({"lr": {"randint": [0.5, 3]}}, "integer bounds"),
        ({"lr": {"uniform": [0, float("inf")]}}, "finite"),
        ({"": [1]}, "non-empty strings"),
    ],
)
def test_malformed_spaces_raise_clear_errors(space, message):
    with pytest.raises(SpecError, match=message):
        parse_space(space)


def test_grid_rejects_distributions():
    with pytest.raises(SpecError, match="grid search needs a list"):
        grid({"lr": {"uniform": [0, 1]}})
    with pytest.raises(SpecError, match="empty"):
        GridSearch({}, epochs=3)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 30))
def test_random_sampling_in_range_distinct_and_deterministic(seed, n):
    space = {**SPACE, "layers": {"randint": [1, 4]}}
    a = sample_configs(space, n, random.Random(seed))
    b = sample_configs(space, n, random.Random(seed))
    assert [c.id for c in a] == [c.id for c in b]
    assert len({c.id for c in a}) == n
    for c in a:
        assert 1e-4 <= c.params["lr"] <= 1e-1
        assert 0.0 <= c.params["dropout"] <= 0.5
        assert c.params["units"] in (16, 32, 64, 128)
        assert c.params["layers"] in (1, 2, 3, 4) and isinstance(c.params["layers"], int)


def test_random_discrete_space_without_replacement_and_budget_errors():
    space = {"a": [1, 2, 3], "b": ["x", "y"]}
    cs = sample_configs(space, 6, random.Random(0))
    assert sorted(tuple(c.params.values()) for c in cs) == sorted(
        (a, b) for a in (1, 2, 3) for b in ("x", "y")
    )
    with pytest.raises(SpecError, match="needs 7 distinct configurations but the space has only 6"):
        sample_configs(space, 7, random.Random(0))
    with pytest.raises(SpecError, match="positive integer"):
        RandomSearch(space, 0, epochs=2)


def test_loguniform_spreads_over_decades():
    cs = sample_configs({"lr": {"loguniform": [1e-5, 1e-1]}}, 400, random.Random(1))
    decades = [math.floor(math.log10(c.params["lr"])) for c in cs]
    assert all(60 <= decades.count(d) <= 140 for d in (-5, -4, -3, -2))


# ----------------------------------------------------------------------------- procedures


def test_grid_and_random_are_one_shot():
    g = GridSearch({"lr": [0.1, 0.01]}, epochs=3)
    ds = run(g, lambda c: c.params["lr"])
    assert len(ds) == 3 and ds[-1].done
    assert [d.stop for d in ds[:2]] == [[], []]
    assert sorted(ds[-1].stop) == sorted(g.configs)
    r = RandomSearch(SPACE, budget=5, epochs=2, seed=3)
    ds = run(r, lambda c: c.params["dropout"])
    assert len(ds) == 2 and len(r.configs) == 5


def test_successive_halving_kills_at_rungs_and_keeps_the_best():
    sh = SuccessiveHalving(SPACE, n_configs=9, max_epochs=9, min_epochs=1, eta=3, seed=0)
    q = lambda c: c.params["dropout"]  # noqa: E731
    ds = run(sh, q)
    best = max(sh.configs.values(), key=q).id
    killed = {1: 6, 3: 2}
    for e, n in killed.items():
        assert len(ds[e - 1].stop) == n
        assert best not in ds[e - 1].stop
    assert len(ds) == 9 and ds[-1].stop == [best]
    assert "max_epochs" in ds[-1].reasons[best]
    assert sh.age[best] == 9


def test_hyperband_brackets_and_best_curve_survives():
    hb = Hyperband(SPACE, max_epochs=9, eta=3, seed=2)
    assert [(b.rungs, len(b.configs)) for b in hb._brackets] == [
        ([1, 3, 9], 9),
        ([3, 9], 5),
        ([9], 3),
    ]
    q = lambda c: c.params["dropout"] + c.params["units"] / 1000  # noqa: E731
    ds = run(hb, q)
    best = max(hb.configs.values(), key=q).id
    assert hb.age[best] == 9  # the best curve trains to the full budget
    trained_full = [m for m in hb.configs if hb.age[m] == 9]
    assert len(trained_full) == 1 + 1 + 3  # one survivor per halving bracket + the 3 of s=0
    for d in ds:
        for m in d.stop:
            if hb.age[m] < 9:
                assert "killed at rung" in d.reasons[m]
                assert hb.age[m] in (1, 3)


def test_hyperband_sequential_adds_brackets_when_previous_ends():
    hb = Hyperband(SPACE, max_epochs=4, eta=2, seed=0, brackets="sequential")
    first = hb.initial()
    assert len(first) == len(hb._brackets[0].configs)
    e, added = 0, []
    while not hb.done:
        e += 1
        d = hb.on_epoch_end(
            e,
            {
                m: {"val_acc": curve(hb.configs[m].params["dropout"], hb.age[m] + 1)}
                for m in hb.live
            },
        )
        if d.add:
            added.append((e, [c.id for c, parent in d.add]))
            assert all(parent is None for _, parent in d.add)
    assert [len(ids) for _, ids in added] == [len(b.configs) for b in hb._brackets[1:]]
    assert sum(1 for b in hb._brackets if b.finished) == len(hb._brackets)


def test_pbt_replaces_the_worst_with_perturbed_copies_of_the_best():
    space = {"lr": {"loguniform": [1e-4, 1.0]}, "units": [8, 16, 32, 64]}
    pbt = PBT(space, population=8, epochs=6, quantile=0.25, seed=1)
    original = {c.id for c in pbt.initial()}
    res = {m: {"val_acc": pbt.configs[m].params["lr"]} for m in pbt.live}
    ranked = sorted(pbt.live, key=lambda m: -res[m]["val_acc"])
    d = pbt.on_epoch_end(1, res)
    assert sorted(d.stop) == sorted(ranked[-2:])
    assert len(d.add) == 2 and len(pbt.live) == 8
    for c, parent in d.add:
        assert parent in ranked[:2]
        p = pbt.configs[parent].params
        assert 1e-4 <= c.params["lr"] <= 1.0 and c.params["units"] in (8, 16, 32, 64)
        assert c.id not in original and "lr" in p
        assert pbt.age[c.id] == pbt.age[parent] and pbt.curves[c.id] == pbt.curves[parent]
        assert "exploited" in d.reasons[d.stop[0]]
    ds = [d] + [
        pbt.on_epoch_end(e, {m: {"val_acc": pbt.configs[m].params["lr"]} for m in pbt.live})
        for e in range(2, 7)
    ]
    assert ds[-1].done and not pbt.live


def test_pbt_moves_population_towards_better_hyperparameters():
    space = {"x": {"uniform": [0.0, 10.0]}}
    pbt2 = PBT(
        space,
        population=12,
        epochs=15,
        quantile=0.25,
        resample_prob=0.1,
        seed=0,
        metric="loss",
        mode="min",
    )
    start = sorted(c.params["x"] for c in pbt2.initial())
    for e in range(1, 15):
        pbt2.on_epoch_end(
            e, {m: {"loss": abs(pbt2.configs[m].params["x"] - 7.0)} for m in pbt2.live}
        )
    end = [abs(pbt2.configs[m].params["x"] - 7.0) for m in pbt2.live]
    assert sorted(end)[len(end) // 2] < sorted(abs(x - 7.0) for x in start)[len(start) // 2]


def test_missing_result_stops_the_model_and_nan_ranks_last():
    sh = SuccessiveHalving({"a": [1, 2, 3, 4, 5, 6]}, n_configs=6, max_epochs=3, eta=3, seed=0)
    ids = [c.id for c in sh.initial()]
    res = {m: {"val_acc": 0.5 + 0.01 * k} for k, m in enumerate(ids[1:])}
    res[ids[1]] = {"val_acc": float("nan")}
    d = sh.on_epoch_end(1, res)
    assert ids[0] in d.stop and "no result" in d.reasons[ids[0]]
    assert ids[1] in d.stop and ids[-1] not in d.stop


def test_epoch_sequence_and_unknown_models_are_checked():
    g = GridSearch({"a": [1, 2]}, epochs=2)
    with pytest.raises(RuntimeError, match="initial"):
        g.on_epoch_end(1, {})
    ids = [c.id for c in g.initial()]
    with pytest.raises(ValueError, match="expected results of epoch 1"):
        g.on_epoch_end(2, {})
    with pytest.raises(ValueError, match="not in S"):
        g.on_epoch_end(1, {"nope": {}})
    g.on_epoch_end(1, {m: {"val_acc": 0.1} for m in ids})
    assert g.on_epoch_end(2, {m: {"val_acc": 0.1} for m in ids}).done
    with pytest.raises(RuntimeError, match="done"):
        g.on_epoch_end(3, {})


@pytest.mark.parametrize("kind", ["grid", "random", "sha", "hyperband", "pbt"])
def test_deterministic_and_replayable(kind):
    space = {"units": [8, 16, 32, 64, 128, 256], "act": ["relu", "tanh", "gelu"]}
    if kind != "grid":
        space["lr"] = {"loguniform": [1e-4, 1e-1]}

    def build():
        return make_search(
            kind,
            space,
            epochs=4,
            budget=9,
            seed=11,
            **({"eta": 2} if kind in ("sha", "hyperband") else {}),
        )

    a, b = build(), build()
    q = lambda c: c.params["units"] / 256 + (0.1 if c.params["act"] == "gelu" else 0)  # noqa: E731
    da, db = run(a, q, noise=0.01, seed=5), run(b, q, noise=0.01, seed=5)
    assert [d.to_json() for d in da] == [d.to_json() for d in db]
    # Replay: a fresh procedure fed the recorded results reaches the same decisions.
    history, c = [], build()
    c.initial()
    rng, e = random.Random(5), 0
    while not c.done:
        e += 1
        res = {
            m: {"val_acc": curve(q(c.configs[m]), c.age[m] + 1) + rng.gauss(0, 0.01)}
            for m in c.live
        }
        history.append((e, res))
        c.on_epoch_end(e, res)
    replayed = build().replay(history)
    assert [d.to_json() for d in replayed] == [d.to_json() for d in da]


def test_make_search_errors():
    with pytest.raises(SpecError, match="unknown search procedure"):
        make_search("bayes", {"a": [1]}, epochs=2)
    with pytest.raises(SpecError, match="needs a budget"):
        make_search("random", {"a": [1]}, epochs=2)
    with pytest.raises(SpecError, match="needs a budget"):
        make_search("pbt", {"a": [1]}, epochs=2)
    with pytest.raises(SpecError, match="bad option"):
        make_search("grid", {"a": [1]}, epochs=2, frobnicate=True)
    with pytest.raises(SpecError, match="eta"):
        make_search("hyperband", {"a": [1]}, epochs=9, eta=1)
    with pytest.raises(SpecError, match="hyperband needs 17 distinct"):
        make_search("hyperband", {"a": [1, 2, 3]}, epochs=9)
    with pytest.raises(SpecError, match="epochs must be a positive integer"):
        make_search("grid", {"a": [1]}, epochs=0)
    with pytest.raises(SpecError, match="mode"):
        make_search("grid", {"a": [1]}, epochs=1, mode="best")
    with pytest.raises(SpecError, match="quantile"):
        make_search("pbt", {"a": [1, 2]}, epochs=2, budget=2, quantile=0.9)
