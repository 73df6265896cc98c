"""Property-based fuzzing of result files: the assimilator never crashes.

Hypothesis builds result file sets from every corner the validator must cover:
valid files with NaN/Inf/huge values, HDF5 files crafted with wrong or missing
attributes, tensors of the wrong shape/dtype/count, compressed and chunked tensors,
unknown jobs and units, truncated and bit-flipped files, non-HDF5 bytes, oversized
files, and metrics files that are not JSON objects. For each, the assimilator's
entry point must end in a clean outcome (merged, duplicate or rejected with its
reason recorded in Redis) and never raise; the server weights stay finite and the
version moves only on a merge.

The property is checked on the parameter server's entry point
(:func:`boinc_dl.server.backends.local.assimilate_message`, what each assimilator process runs
per result), and on ``assimilate_files`` (what the BOINC scripts call) for an
array-valued attribute, which once let a ``TypeError`` escape ``read_header``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.local import assimilate_message
from boinc_dl.server.common.errors import ResultRejected
from boinc_dl.server.common.weights import FORMAT, WeightsFile, write_weights
from tests.support.results import assimilate_files, validate

from .conftest import REPO, tiny_fingerprint, tiny_spec

FP = tiny_fingerprint()
N_UNITS = 40
# Three jobs: plain, with an update-norm bound, and with a tiny upload limit.
JOBS = {
    "fz": tiny_spec("fz"),
    "fznorm": tiny_spec("fznorm", validation={"max_update_norm": 50.0}),
    "fzsize": tiny_spec("fzsize", units={"max_upload_bytes": 6000}),
}
# Huge weights overflow the update-norm computation to inf (then rejected): expected.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
FUZZ = settings(max_examples=int(os.environ.get("BDL_FUZZ_EXAMPLES", "200")), deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> Iterator[dict[str, JobStore]]:
    srv = EmbeddedRedis(tmp_path_factory.mktemp("fuzz-redis")).start()
    r = connect(srv.url)
    out = {}
    for name, spec in JOBS.items():
        store = JobStore(r, name)
        store.create(spec.model_dump_json(), "vcasgd", {"0": FP}, {})
        store.init_weights("0", np.zeros(FP.n_params, np.float32))
        for i in range(N_UNITS):
            store.register_unit(f"u{i}", {"epoch": 1 + i // 4, "shard": i % 4, "model": "0"}, 1 + i // 4)
        out[name] = store
    yield out
    srv.kill()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz-files")


_counter = itertools.count()

# No NUL: HDF5 variable-length strings cannot hold one (h5py refuses to write it).
names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"], exclude_characters="\0"), max_size=12)
issued_units = st.sampled_from([f"u{i}" for i in range(N_UNITS)])
units = st.one_of(issued_units, names)


def embedded(issued: str) -> st.SearchStrategy[str]:
    """The unit a file claims: mostly the one it was issued for, sometimes another or junk."""
    return st.one_of(st.just(issued), st.just(issued), st.just(issued), units)


def jobs_for(job: str) -> st.SearchStrategy[str]:
    """Mostly the result's own job (so the deeper checks run), sometimes another or junk."""
    return st.one_of(st.just(job), st.just(job), st.just(job), st.sampled_from(list(JOBS)), names)

values = st.sampled_from(["small", "zeros", "nan", "inf", "-inf", "huge", "big-norm", "random"])
attr_values = st.one_of(st.integers(-2**40, 2**40), st.floats(allow_nan=True), names,
                        st.binary(max_size=16).filter(lambda b: b"\0" not in b),
                        st.lists(st.integers(-5, 5), max_size=3))


def _flat(kind: str, rng: np.random.Generator) -> np.ndarray:
    n = FP.n_params
    flat = {"small": lambda: rng.normal(0, 0.1, n), "zeros": lambda: np.zeros(n),
            "huge": lambda: np.full(n, 3e38), "big-norm": lambda: np.full(n, 30.0),
            "random": lambda: rng.normal(0, 10, n)}.get(kind, lambda: rng.normal(0, 1, n))()
    flat = flat.astype(np.float32)
    if kind in ("nan", "inf", "-inf"):
        flat[rng.integers(0, n)] = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}[kind]
    return flat


@st.composite
def weights_file(draw, path: Path, job: str, issued: str) -> str:  # noqa: ANN001
    """Write one weights-like file at ``path``; returns a label of what it is."""
    kind = draw(st.sampled_from(["valid", "valid", "crafted", "crafted", "garbage", "empty", "hdf5-empty"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "valid":
        wf = WeightsFile(_flat(draw(values), rng), FP, job=draw(jobs_for(job)), model=draw(st.sampled_from(["0", "0", "1"])),
                         unit=draw(embedded(issued)), base_version=draw(st.integers(0, 2**31)),
                         examples_seen=draw(st.integers(0, 2**31)),
                         metrics=draw(st.dictionaries(names, st.integers(), max_size=3)))
        write_weights(path, wf)
    elif kind == "garbage":
        head = b"\x89HDF\r\n\x1a\n" if draw(st.booleans()) else b""
        path.write_bytes(head + draw(st.binary(max_size=2048)))
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "hdf5-empty":
        with h5py.File(path, "w", libver="latest"):
            pass
    else:
        _crafted(draw, path, rng, job, issued)
    return kind


def _crafted(draw, path: Path, rng: np.random.Generator, job: str, issued: str) -> None:  # noqa: ANN001
    """An HDF5 file in our layout with some parts wrong: attributes, tensors or both."""
    with h5py.File(path, "w", libver=draw(st.sampled_from(["latest", "latest", "earliest"]))) as f:
        for key, good in (("format", FORMAT), ("fingerprint", FP.to_json()), ("job", draw(jobs_for(job))),
                          ("model", "0"), ("unit", draw(embedded(issued))), ("base_version", 0),
                          ("examples_seen", 10), ("metrics", "{}")):
            choice = draw(st.sampled_from(["good", "good", "good", "missing", "weird"]))
            if choice == "good":
                f.attrs[key] = good
            elif choice == "weird":
                f.attrs[key] = draw(attr_values)
        if draw(st.booleans()):
            f.attrs["fingerprint"] = json.dumps(draw(st.lists(
                st.tuples(names, st.lists(st.integers(-2, 6), max_size=3), st.sampled_from(["float32", "int8"])),
                max_size=4)))
        layout = draw(st.sampled_from(["ok", "ok", "none", "group-is-dataset", "extra", "missing", "shapes",
                                       "dtypes", "chunked", "nested"]))
        if layout == "none":
            return
        if layout == "group-is-dataset":
            f.create_dataset("tensors", data=np.zeros(3))
            return
        g = f.create_group("tensors")
        specs = list(FP.tensors)
        if layout == "extra":
            specs = specs + specs[:1]
        if layout == "missing":
            specs = specs[:-1]
        for i, t in enumerate(specs):
            shape = t.shape
            if layout == "shapes" and draw(st.booleans()):
                shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
            dtype = "<f4"
            if layout == "dtypes" and draw(st.booleans()):
                dtype = draw(st.sampled_from(["<f8", "<f2", "<i4", "|u1", "|b1"]))
            data = rng.normal(0, 1, shape).astype(dtype) if shape else np.asarray(1.0, dtype)
            key = f"{i:06d}"
            if layout == "nested" and i == 0:
                g.create_group(key)
                continue
            if layout == "chunked" and data.ndim:
                ds = g.create_dataset(key, data=data, chunks=True, compression="gzip")
            else:
                ds = g.create_dataset(key, data=data)
            ds.attrs["name"] = t.name


@st.composite
def metrics_file(draw, path: Path) -> bool:  # noqa: ANN001
    kind = draw(st.sampled_from(["object", "object", "text", "binary", "list", "absent"]))
    if kind == "absent":
        return False
    if kind == "object":
        path.write_text(json.dumps(draw(st.dictionaries(names, st.one_of(st.integers(), names, st.none()),
                                                        max_size=4))))
    elif kind == "text":
        path.write_text(draw(st.text(max_size=200)))
    elif kind == "binary":
        path.write_bytes(draw(st.binary(max_size=200)))
    else:
        path.write_text(json.dumps(draw(st.lists(st.integers(), max_size=4))))
    return True


def _check_outcome(store: JobStore, out, before_version: int, before_rejections: int) -> None:  # noqa: ANN001
    assert out.status in ("merged", "duplicate", "rejected"), out
    after = store.version("0")
    if out.status == "merged":
        assert after >= before_version + 1
    if out.status == "rejected":
        assert out.reason
        assert store.counters().get("rejected", 0) == before_rejections + 1
        assert store.rejections(1)[0]["reason"] == out.reason
    w, _ = store.get_weights("0")
    assert np.isfinite(w).all()


@FUZZ
@given(data=st.data())
def test_fuzzed_result_files_never_crash_the_assimilator(stores, workdir, data) -> None:
    job = data.draw(st.sampled_from(list(JOBS)))
    store, spec = stores[job], JOBS[job]
    d = workdir / f"r{next(_counter)}"
    d.mkdir()
    issued = data.draw(issued_units)  # what the job system issued: known, never from the file
    try:
        data.draw(weights_file(d / "weights_out.h5", job, issued))
        paths = [str(d / "weights_out.h5")]
        if data.draw(metrics_file(d / "metrics.json")):
            paths.append(str(d / "metrics.json"))
        extra = data.draw(st.sampled_from(["none", "none", "missing", "dir", "dup"]))
        if extra == "missing":
            paths.append(str(d / "nope.h5"))
        elif extra == "dir":
            paths.append(str(d))
        elif extra == "dup":
            paths.append(paths[0])
        paths = data.draw(st.permutations(paths))
        v0, r0 = store.version("0"), store.counters().get("rejected", 0)
        out = assimilate_message(store, spec, "result", d.name, issued, paths)
        _check_outcome(store, out, v0, r0)
        if out.status == "merged":
            assert store.is_assimilated(issued)
        try:
            validate(paths, store, spec.units.max_upload_bytes, issued)
        except ResultRejected as e:
            assert e.reason
    finally:
        shutil.rmtree(d, ignore_errors=True)


@FUZZ
@given(data=st.data())
def test_mutated_bytes_of_valid_results_never_crash(stores, workdir, data) -> None:
    """A valid result, then truncated, bit-flipped, zeroed or spliced at random places."""
    store, spec = stores["fz"], JOBS["fz"]
    d = workdir / f"m{next(_counter)}"
    d.mkdir()
    try:
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        w = d / "weights_out.h5"
        issued = data.draw(issued_units)
        write_weights(w, WeightsFile(_flat("small", rng), FP, job="fz", model="0",
                                     unit=data.draw(embedded(issued)), base_version=1))
        raw = bytearray(w.read_bytes())
        for _ in range(data.draw(st.integers(1, 4))):
            op = data.draw(st.sampled_from(["truncate", "flip", "zero", "splice"]))
            pos = data.draw(st.integers(0, max(0, len(raw) - 1)))
            if op == "truncate":
                raw = raw[:pos]
            elif op == "flip" and raw:
                raw[pos] ^= 1 << data.draw(st.integers(0, 7))
            elif op == "zero":
                raw[pos:pos + data.draw(st.integers(1, 64))] = b"\0" * len(raw[pos:pos + 64][:64])
            elif op == "splice":
                raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=32))
        w.write_bytes(bytes(raw))
        (d / "metrics.json").write_text("{}")
        v0, r0 = store.version("0"), store.counters().get("rejected", 0)
        out = assimilate_message(store, spec, "result", d.name, issued, [str(w), str(d / "metrics.json")])
        _check_outcome(store, out, v0, r0)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_unknown_job_store_rejects_cleanly(stores, tmp_path: Path) -> None:
    """A result for a job this Redis does not hold: rejected, nothing merged."""
    ghost = JobStore(stores["fz"].r, "ghost")
    d = tmp_path / "g"
    d.mkdir()
    write_weights(d / "w.h5", WeightsFile(np.zeros(FP.n_params, np.float32), FP, job="ghost", unit="u0"))
    with pytest.raises(ResultRejected, match="unknown unit 'u0' for job 'ghost'"):
        validate([str(d / "w.h5")], ghost, 10**9, "u0")
    out = assimilate_files(ghost, [str(d / "w.h5")], JOBS["fz"], "g_0", unit="u0")
    assert out.status == "ignored" and "not in Redis" in out.reason


def _array_attr_result(d: Path) -> list[str]:
    d.mkdir()
    with h5py.File(d / "w.h5", "w", libver="latest") as f:
        f.attrs["format"] = FORMAT
        f.attrs["fingerprint"] = FP.to_json()
        f.attrs["job"], f.attrs["unit"] = "fz", "u1"
        f.attrs["base_version"] = [1, 2]  # an array where an integer belongs
    return [str(d / "w.h5")]


def test_array_attribute_is_rejected_by_the_parameter_server(stores, tmp_path: Path) -> None:
    out = assimilate_message(stores["fz"], JOBS["fz"], "result", "arr_0", "u1", _array_attr_result(tmp_path / "a"))
    assert out.status == "rejected" and out.reason


def test_array_attribute_through_assimilate_files(stores, tmp_path: Path) -> None:
    """The BOINC script entry point calls assimilate_files directly: this must reject too."""
    out = assimilate_files(stores["fz"], _array_attr_result(tmp_path / "b"), JOBS["fz"], "arr_1", unit="u1")
    assert out.status == "rejected"


def _one_of_each_kind(d: Path) -> dict[str, tuple[str, list[str]]]:
    """One result of each failure kind the campaigns draw, built here: {needle: (job, paths)}.

    The check used to read what the campaigns had recorded, so it depended on which
    tests ran before it in the same process (under xdist, a full run split the module
    across workers and it failed with ``AssertionError: superblock``)."""
    d.mkdir()
    valid_w = d / "valid.h5"
    write_weights(valid_w, WeightsFile(np.zeros(FP.n_params, np.float32), FP, job="fz", model="0", unit="kinds"))
    (d / "bad.json").write_text("{oops")
    (d / "garbage.h5").write_bytes(b"\x89HDF but not really" + bytes(64))
    (d / "big.h5").write_bytes(valid_w.read_bytes() + bytes(8000))
    with h5py.File(d / "earliest.h5", "w", libver="earliest") as f:
        f.attrs["format"] = FORMAT
    return {
        "not JSON": ("fz", [str(valid_w), str(d / "bad.json")]),
        "over the": ("fzsize", [str(d / "big.h5")]),
        "signature": ("fz", [str(d / "garbage.h5")]),
        "superblock": ("fz", [str(d / "earliest.h5")]),
    }


def test_each_kind_of_bad_result_is_rejected_with_its_reason(stores, tmp_path: Path) -> None:
    """The failure kinds the campaigns exercise, each rejected with a reason that says
    which (deterministic: whatever ran before, in whatever process)."""
    for needle, (job, paths) in _one_of_each_kind(tmp_path / "kinds").items():
        store = stores[job]
        store.register_unit("kinds", {"epoch": 1, "shard": 0, "model": "0"}, 1)  # never merged by a campaign
        out = assimilate_message(store, JOBS[job], "result", f"kind_{needle[:3]}", "kinds", paths)
        assert out.status == "rejected" and needle in out.reason, (needle, out)
        assert store.rejections(1)[0]["reason"] == out.reason
    assert math.isfinite(stores["fznorm"].get_weights("0")[0].sum())


def test_a_host_cannot_name_its_refused_results(stores, tmp_path: Path) -> None:
    """Rejections are recorded once per result name: the name is the job system's, so two
    refused results whose metrics name the same (someone else's) result are both counted."""
    store = stores["fznorm"]
    before = store.counters().get("rejected", 0)
    for name in ("liar_a_0", "liar_b_0"):
        d = tmp_path / name
        d.mkdir()
        write_weights(d / "w.h5", WeightsFile(np.full(FP.n_params, 500.0, np.float32), FP, job="fznorm", unit="u2"))
        (d / "metrics.json").write_text(json.dumps({"result": "honest_result_0", "val_acc": 0.5}))
        out = assimilate_message(store, JOBS["fznorm"], "result", name, "u2", [str(d / "w.h5"), str(d / "metrics.json")])
        assert out.status == "rejected" and "max_update_norm" in out.reason
    assert store.counters()["rejected"] == before + 2
    assert {r["result"] for r in store.rejections(10)} >= {"liar_a_0", "liar_b_0"}
    assert "honest_result_0" not in {r["result"] for r in store.rejections(10)}


#: A unit name as long as a user's job gives (job name, epoch, subset, re-run).
LONG_UNIT = "walkjob-breastcancer-2026_e12_s31_r2"


def test_rejections_are_visible_in_boinc_dl_status(stores, tmp_path: Path) -> None:
    """``boinc-dl status`` lists each rejected result with its reason."""
    store = stores["fznorm"]
    for i, (flat, unit) in enumerate([(np.full(FP.n_params, np.nan, np.float32), "u2"),
                                      (np.full(FP.n_params, 500.0, np.float32), "u3"),
                                      (np.zeros(FP.n_params, np.float32), "nosuchunit"),
                                      (np.zeros(FP.n_params, np.float32), LONG_UNIT)]):
        d = tmp_path / f"s{i}"
        d.mkdir()
        write_weights(d / "w.h5", WeightsFile(flat, FP, job="fznorm", unit=unit))
        (d / "metrics.json").write_text("{oops")
        paths = [str(d / "w.h5")] + ([str(d / "metrics.json")] if i == 0 else [])
        assert assimilate_message(store, JOBS["fznorm"], "result", f"s{i}_0", unit, paths).status == "rejected"
    url = store.r.connection_pool.connection_kwargs
    redis_url = f"unix://{url['path']}" if "path" in url else f"redis://{url['host']}:{url['port']}"
    res = subprocess.run([sys.executable, "-m", "boinc_dl.server.cli", "status", "fznorm", "--redis-url", redis_url,
                          "--json"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    reasons = [r["reason"] for r in st["rejections"]]
    assert any("not JSON" in r for r in reasons)
    assert any("exceeds max_update_norm" in r for r in reasons)
    assert any("unknown unit" in r for r in reasons)
    assert st["counters"]["rejected"] >= 3
    table = subprocess.run([sys.executable, "-m", "boinc_dl.server.cli", "status", "fznorm", "--redis-url", redis_url],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "300"})
    assert "rejected results" in table.stdout and "exceeds max_update_norm" in table.stdout
    # In an 80-column terminal the unit's name is printed whole (the reason wraps instead).
    narrow = subprocess.run([sys.executable, "-m", "boinc_dl.server.cli", "status", "fznorm", "--redis-url", redis_url],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80"})
    assert narrow.returncode == 0, narrow.stderr
    assert LONG_UNIT in narrow.stdout, narrow.stdout


def test_fuzz_files_are_cleaned_up(workdir) -> None:
    assert not any(p for p in Path(workdir).iterdir() if p.is_dir()), list(Path(workdir).iterdir())[:3]
