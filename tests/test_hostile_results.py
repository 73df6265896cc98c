"""Hostile results, class by class: each attack of tests/hostile_corpus.py is rejected
with its reason, before any data is read, and nothing of it reaches the server weights
or the file system.

* the weights reader: external storage/links, soft links, aliases, virtual datasets,
  filters, declared sizes, dtypes, truncation, user blocks, drivers, extra objects;
* identity: a result is merged only into the unit the job system issued it for;
* paths: no untrusted string builds a path (the ``../`` unit id hole, reproduced);
* bounded parsing: metrics JSON (size, nesting), gzip bombs;
* values: the adaptive update-distance bound (poisoning rejected, honest updates kept);
* accounting: a unit is never both given up and merged.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from boinc_dl.server.backends.local import assimilate_message
from boinc_dl.server.common import bounded, h5bounds
from boinc_dl.server.common.errors import ResultRejected, WeightsFormatError
from boinc_dl.server.common.paths import check_name, confined, is_safe_name
from boinc_dl.server.common.weights import (
    WeightsFile,
    read_header,
    read_weights,
    upload_bound,
    write_weights,
)
from boinc_dl.server.validator.checks import read_metrics
from tests.support.audit import audit_job
from tests.support.h5craft import set_vlen_length
from tests.support.results import assimilate_error, assimilate_files, validate

from .conftest import REPO, tiny_fingerprint
from .hostile_corpus import (
    ATTACKS,
    HUGE,
    METRICS_ATTACKS,
    SECRET,
    TRAVERSAL_UNITS,
    deep_groups,
    gzip_bomb,
    huge_heap_collection,
    secret_files,
    valid,
    vlen_attribute,
    vlen_length_lie,
    wide_group,
)

FP = tiny_fingerprint()
BY_NAME = {a.name: a for a in ATTACKS}


def _secret_floats() -> np.ndarray:
    return np.frombuffer((SECRET * 4)[: 4 * FP.n_params], "<f4")


# ---- the weights reader ----------------------------------------------------------------------

@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_reader_rejects_each_attack(tmp_path: Path, attack) -> None:
    path = tmp_path / "weights_out.h5"
    attack.build(path, FP, "tiny", "u0", tmp_path / "server")
    with pytest.raises(WeightsFormatError, match=attack.reason):
        read_weights(path, FP, max_bytes=10 << 20)
    # Without the expected fingerprint (the file's own one) it is refused too.
    with pytest.raises(WeightsFormatError):
        read_weights(path, max_bytes=10 << 20)


@pytest.mark.parametrize("name", ["external-storage", "external-link", "virtual-dataset", "external-link-group",
                                  "external-storage-v2", "external-link-v2", "virtual-dataset-v2"])
def test_server_file_never_reaches_the_weights(tiny_job, tmp_path: Path, name: str) -> None:
    """The critical hole: a tensor stored in (or linked to) a server file was merged."""
    store, spec, fp = tiny_job
    d = tmp_path / "r"
    d.mkdir()
    BY_NAME[name].build(d / "weights_out.h5", fp, "tiny", "u0", tmp_path / "server")
    (d / "metrics.json").write_text("{}")
    out = assimilate_files(store, [str(d / "weights_out.h5"), str(d / "metrics.json")], spec, "u0_0", unit="u0")
    assert out.status == "rejected", out
    w, v = store.get_weights("0")
    assert v == 0 and not np.isin(_secret_floats(), w).any()


def test_valid_file_with_optimizer_state_reads(tmp_path: Path) -> None:
    valid(tmp_path / "w.h5", FP, "j", "u", optimizer=True)
    wf = read_weights(tmp_path / "w.h5", FP, max_bytes=1 << 20)
    assert wf.optimizer is not None and [a.shape for a in wf.optimizer.arrays] == [(FP.n_params,), ()]
    assert read_header(tmp_path / "w.h5").unit == "u"


def test_optimizer_state_is_bounded_by_the_model(tmp_path: Path) -> None:
    from boinc_dl.server.common.weights import OptimizerState

    flat = np.zeros(FP.n_params, np.float32)
    big = OptimizerState("adam", [np.zeros(4 * FP.n_params + 17, np.float32)])
    write_weights(tmp_path / "w.h5", WeightsFile(flat, FP, job="j", unit="u", optimizer=big))
    with pytest.raises(WeightsFormatError, match="optimizer state has"):
        read_weights(tmp_path / "w.h5", FP)
    many = OptimizerState("adam", [np.zeros(1, np.float32)] * (4 * len(FP.tensors) + 17))
    write_weights(tmp_path / "w.h5", WeightsFile(flat, FP, job="j", unit="u", optimizer=many))
    with pytest.raises(WeightsFormatError, match="/optimizer holds 25 objects, at most 24"):
        read_weights(tmp_path / "w.h5", FP)


def test_file_size_bound_checked_before_opening(tmp_path: Path) -> None:
    valid(tmp_path / "w.h5", FP, "j", "u")
    with pytest.raises(WeightsFormatError, match="over the 100-byte bound"):
        read_weights(tmp_path / "w.h5", FP, max_bytes=100)
    with pytest.raises(WeightsFormatError, match="not a regular file"):
        read_weights("/dev/zero", FP)


@pytest.mark.parametrize("name", ["huge-tensor", "huge-optimizer", "huge-fingerprint", "huge-tensor-v2",
                                  "huge-fingerprint-v2"])
def test_declared_2e9_values_rejected_fast_and_small(tmp_path: Path, name: str) -> None:
    """A few-KB file declaring 2e9 float32 (8 GB): rejected in well under a second,
    allocating a few MB at most (tracemalloc sees numpy's allocations)."""
    path = tmp_path / "w.h5"
    BY_NAME[name].build(path, FP, "j", "u", tmp_path)
    assert path.stat().st_size < 64 << 10
    tracemalloc.start()
    t0 = time.perf_counter()
    for expected in (FP, None):
        with pytest.raises(WeightsFormatError):
            read_weights(path, expected, max_bytes=10 << 20)
    took = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert took < 0.5 and peak < 4 << 20, (took, peak)


def test_declared_size_peak_rss_in_a_subprocess(tmp_path: Path) -> None:
    """The same in a fresh process, by its peak resident set (HDF5's own C allocations
    included; the high-water mark reset just before the call): a few MB at most."""
    path = tmp_path / "w.h5"
    BY_NAME["huge-optimizer"].build(path, FP, "j", "u", tmp_path)
    code = (
        "import sys\n"
        "from boinc_dl.server.common.weights import read_weights\n"
        "from tests.conftest import tiny_fingerprint\n"
        "def kib(k):\n"
        "    return next(int(x.split()[1]) for x in open('/proc/self/status') if x.startswith(k + ':'))\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        "before = kib('VmRSS')\n"
        "try:\n    read_weights(sys.argv[1], tiny_fingerprint())\nexcept Exception as e:\n    print(type(e).__name__)\n"
        "print(kib('VmHWM') - before)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, check=True).stdout.split()
    assert out[0] == "WeightsFormatError"
    assert int(out[1]) < 8 << 10, f"peak RSS grew by {out[1]} KiB"


# ---- identity ------------------------------------------------------------------------------

def _result(d: Path, *, job: str = "tiny", unit: str = "u0", flat: np.ndarray | None = None,
            metrics: bytes = b"{}") -> list[str]:
    d.mkdir(parents=True, exist_ok=True)
    flat = np.full(FP.n_params, 0.5, np.float32) if flat is None else flat
    write_weights(d / "weights_out.h5", WeightsFile(flat, FP, job=job, model="0", unit=unit))
    (d / "metrics.json").write_bytes(metrics)
    return [str(d / "weights_out.h5"), str(d / "metrics.json")]


@pytest.mark.parametrize(("job", "unit", "reason"), [
    ("tiny", "u1", "embeds unit 'u1', but was uploaded for 'u0'"),  # another known unit
    ("tiny", "nosuch", "embeds unit"),
    ("other", "u0", "embeds job 'other'"),
    ("", "", "embeds job"),
])
def test_result_merges_only_into_its_issued_unit(tiny_job, tmp_path: Path, job, unit, reason) -> None:
    store, spec, _fp = tiny_job
    paths = _result(tmp_path / "r", job=job, unit=unit)
    with pytest.raises(ResultRejected, match=reason):
        validate(paths, store, 10**9, "u0")
    out = assimilate_message(store, spec, "result", "r_0", "u0", paths)  # the local backend's entry
    assert out.status == "rejected" and reason.split(",")[0] in out.reason and out.unit == "u0"
    assert store.version("0") == 0 and not store.assimilated()
    assert store.rejections(1)[0]["unit"] == "u0"  # recorded against the issued unit


def test_unit_comes_from_the_result_name_not_the_file(tiny_job, tmp_path: Path) -> None:
    store, spec, _fp = tiny_job
    paths = _result(tmp_path / "r", unit="u2")
    out = assimilate_files(store, paths, spec, "u1_0")  # BOINC: result u1_0 of workunit u1
    assert out.status == "rejected" and "uploaded for 'u1'" in out.reason
    out = assimilate_files(store, paths, spec, "nosuch_0")
    assert out.status == "rejected" and "not a result of a known unit" in out.reason
    assert assimilate_files(store, paths, spec, "u2_3").status == "merged"
    assert list(store.assimilated()) == ["u2"]


def test_unsafe_issued_unit_is_refused(tiny_job, tmp_path: Path) -> None:
    store, spec, _fp = tiny_job
    paths = _result(tmp_path / "r", unit="../../x")
    for unit in ("../../x", "", "a/b"):
        with pytest.raises(ResultRejected, match="not a safe name"):
            validate(paths, store, 10**9, unit)


def test_symlinked_result_file_is_refused(tiny_job, tmp_path: Path) -> None:
    store, spec, _fp = tiny_job
    paths = _result(tmp_path / "r")
    link = tmp_path / "r" / "link.h5"
    link.symlink_to(paths[0])
    with pytest.raises(ResultRejected, match="symbolic link"):
        validate([str(link), paths[1]], store, 10**9, "u0")


# ---- paths -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TRAVERSAL_UNITS)
def test_unsafe_names_never_build_a_path(tmp_path: Path, name: str) -> None:
    assert not is_safe_name(name)
    with pytest.raises(ResultRejected):
        check_name(name)
    with pytest.raises(ResultRejected):
        confined(tmp_path, name)


def test_confined_follows_symlinks_out(tmp_path: Path) -> None:
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "out").symlink_to(tmp_path)
    assert confined(tmp_path / "base", "ok") == (tmp_path / "base" / "ok").resolve()
    with pytest.raises(ResultRejected, match="escapes"):
        confined(tmp_path / "base", "out")


# ---- bounded parsing -------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(METRICS_ATTACKS))
def test_hostile_metrics_rejected(tmp_path: Path, name: str) -> None:
    data, reason = METRICS_ATTACKS[name]
    (tmp_path / "m.json").write_bytes(data)
    t0 = time.perf_counter()
    with pytest.raises(ResultRejected, match=reason):
        read_metrics(tmp_path / "m.json")
    assert time.perf_counter() - t0 < 1.0


def test_bounded_json_never_recurses() -> None:
    for text in ("[" * 1_000_000, '{"a":' * 300_000, "[" * 33 + "]" * 33):
        with pytest.raises(bounded.BoundExceeded):
            bounded.loads(text, max_bytes=10 << 20)
    assert bounded.loads('{"a": [1, {"b": "]]]["}]}') == {"a": [1, {"b": "]]]["}]}


def test_gzip_bomb_stops_at_the_bound(tmp_path: Path) -> None:
    bomb = gzip_bomb(tmp_path / "bomb.gz", 256 << 20)  # 256 MB of zeros, ~250 KB on disk
    assert bomb.stat().st_size < 1 << 20
    t0 = time.perf_counter()
    with pytest.raises(bounded.BoundExceeded):
        bounded.gunzip_bounded(bomb, tmp_path / "out", 4 << 20)
    assert time.perf_counter() - t0 < 1.0
    assert (tmp_path / "out").stat().st_size <= 4 << 20
    assert bounded.gunzip_bounded(bomb, tmp_path / "out", 256 << 20) == 256 << 20


# ---- values ----------------------------------------------------------------------------------

def test_an_update_beyond_the_trusted_radius_is_clipped_and_feeds_nothing(tiny_job, tmp_path: Path) -> None:
    """Trusted results (the local backend's hosts) set the clip radius; an untrusted
    result far beyond it is shortened to it, and its norm never enters the statistics."""
    from boinc_dl.server.assimilator import policy
    from boinc_dl.server.assimilator.framework import Delivery, assimilate

    store, spec, fp = tiny_job
    spec = spec.model_copy(update={"validation": spec.validation.model_copy(update={"clip_min_trusted": 3})})
    rng = np.random.default_rng(1)
    base = np.zeros(fp.n_params, np.float32)  # every unit's base: version 0 (zeros)
    for i in range(4):  # trusted, honest: steps of norm ~0.77
        flat = (base + rng.normal(0, 0.2, fp.n_params)).astype(np.float32)
        files = _result(tmp_path / f"h{i}", unit=f"u{i}", flat=flat)
        out = assimilate(store, Delivery(f"u{i}", unit=f"u{i}", files=[Path(p) for p in files], trusted=True),
                         spec=spec)
        assert out.status == "merged", out
    radius = policy.trusted_radius(store, spec, "0", 1)
    assert radius is not None and 1.0 < radius < 2.5  # 2 x the median trusted norm, frozen for epoch 1
    v = store.version("0")
    ws_before, _ = store.get_weights("0")
    poison = np.full(fp.n_params, 1000.0, np.float32)  # an untrusted host's huge update
    files = _result(tmp_path / "p", unit="u4", flat=poison)
    out = assimilate(store, Delivery("u4", unit="u4", files=[Path(p) for p in files]), spec=spec)
    assert out.status == "merged" and store.version("0") == v + 1
    rec = store.assimilated()["u4"]
    assert rec["clip_scale"] < 0.01 and rec["trusted"] is False
    moved = float(np.linalg.norm(store.get_weights("0")[0] - ws_before))
    assert moved <= radius * 1.0001  # the update applied is at most the radius (delta rule, lr 1)
    assert len(store.trusted_values("0", policy.RADIUS, 256)) == 4  # its norm fed nothing
    assert policy.trusted_radius(store, spec, "0", 1) == radius  # frozen


def test_max_update_norm_refuses_and_the_paper_rule_is_kept(tiny_job, tmp_path: Path) -> None:
    store, spec, fp = tiny_job
    spec2 = spec.model_copy(update={"validation": spec.validation.model_copy(update={"max_update_norm": 1e-3})})
    out = assimilate_files(store, _result(tmp_path / "q", unit="u5", flat=np.full(fp.n_params, 0.1, np.float32)),
                           spec2, unit="u5")
    assert out.status == "rejected" and "max_update_norm" in out.reason
    paper = spec.model_copy(update={"vcasgd": spec.vcasgd.model_copy(update={"merge_rule": "paper", "alpha": 0.5})})
    out = assimilate_files(store, _result(tmp_path / "r", unit="u6", flat=np.full(fp.n_params, 2.0, np.float32)),
                           paper, unit="u6")
    assert out.status == "merged"
    np.testing.assert_allclose(store.get_weights("0")[0], 1.0)  # 0.5 * 0 + 0.5 * 2
    assert store.assimilated()["u6"]["merge_rule"] == "paper(a=0.5)"


# ---- accounting ------------------------------------------------------------------------------

def test_given_up_unit_is_never_merged_and_vice_versa(tiny_job, tmp_path: Path) -> None:
    store, spec, _fp = tiny_job
    assert assimilate_error(store, "u0", "too many errors").status == "failed"
    out = assimilate_files(store, _result(tmp_path / "late"), spec, unit="u0")  # a late good result
    assert out.status == "duplicate" and "given up" in out.reason
    assert store.version("0") == 0 and "u0" not in store.assimilated() and "u0" in store.failed()
    assert assimilate_files(store, _result(tmp_path / "ok", unit="u1"), spec, unit="u1").status == "merged"
    assimilate_error(store, "u1", "late error call")
    assert "u1" not in store.failed()
    counts = store.epoch_counts(1)
    assert (counts["assimilated"], counts["failed"]) == (1, 1)
    a = audit_job(store, n_subsets=4)
    assert not [p for p in a.problems if "both" in p], a.problems


def test_metrics_json_in_the_result_is_bounded(tiny_job, tmp_path: Path) -> None:
    store, spec, _fp = tiny_job
    paths = _result(tmp_path / "r", metrics=b"[" * 200_000)
    out = assimilate_files(store, paths, spec, unit="u0")
    assert out.status == "rejected" and "nested" in out.reason


def test_huge_declaration_through_the_validator(tiny_job, tmp_path: Path) -> None:
    store, spec, fp = tiny_job
    d = tmp_path / "r"
    d.mkdir()
    BY_NAME["huge-optimizer"].build(d / "weights_out.h5", fp, "tiny", "u0", tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(ResultRejected, match=str(4 * HUGE)):
        validate([str(d / "weights_out.h5")], store, spec.units.max_upload_bytes, "u0")
    assert time.perf_counter() - t0 < 1.0


# ---- structure-aware fuzzing of the reader ---------------------------------------------------

_REPLACEMENTS = ["chunked", "external-storage", "external-link", "soft-link", "hard-alias", "virtual",
                 "gzip", "shuffle", "fletcher32", "unallocated", "shape", "float64", "big-endian", "huge",
                 "scalar"]
_BENIGN = {"chunked"}
_EXTRAS = ["root-attr", "root-dataset", "tensor-attr", "optimizer-ok", "optimizer-huge", "optimizer-text",
           "metrics-deep", "unit-array", "vlen-format", "vlen-metrics", "vlen-job", "nested-groups"]
# A variable-length attribute under its bound is benign (all of write_weights' strings are).
_BENIGN_EXTRAS = {"optimizer-ok", "vlen-job"}
READER_FUZZ = settings(max_examples=int(os.environ.get("BDL_FUZZ_EXAMPLES", "60")), deadline=None,
                       derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _mutate_tensor(f: h5py.File, i: int, how: str, secret: Path, secret_h5: Path) -> None:
    """Replace tensor ``i`` of a version-1 file, or ``/flat`` of a version-2 one."""
    if "flat" in f:
        g, k, shape = f, "flat", (FP.n_params,)
    else:
        g, k, shape = f["tensors"], f"{i:06d}", FP.tensors[i].shape
    size = int(np.prod(shape))
    data = g[k][()]
    del g[k]
    if how == "chunked":
        g.create_dataset(k, data=data, chunks=True)
    elif how == "external-storage":
        g.create_dataset(k, shape=shape, dtype="<f4", external=[(str(secret), 0, 4 * size)])
    elif how == "external-link":
        g[k] = h5py.ExternalLink(str(secret_h5), "/data")
    elif how == "soft-link":
        other = f"/tensors/{(i + 1) % len(FP.tensors):06d}" if k != "flat" else "/moved"
        if k == "flat":
            f["moved"] = data
        g[k] = h5py.SoftLink(other)
    elif how == "hard-alias":
        g.create_dataset(k, data=data)
        f[f"alias{i}"] = g[k]
    elif how == "virtual":
        lay = h5py.VirtualLayout(shape=(size,), dtype="<f4")
        lay[:] = h5py.VirtualSource(str(secret_h5), "data", shape=(4 * FP.n_params,))[:size]
        g.create_virtual_dataset(k, lay)
    elif how in ("gzip", "shuffle", "fletcher32"):
        g.create_dataset(k, data=data, chunks=True, **{"gzip": {"compression": "gzip"}, "shuffle": {"shuffle": True},
                                                        "fletcher32": {"fletcher32": True}}[how])
    elif how == "unallocated":
        g.create_dataset(k, shape=shape, dtype="<f4")
    elif how == "shape":
        g.create_dataset(k, data=np.zeros(size + 1, np.float32))
    elif how in ("float64", "big-endian"):
        g.create_dataset(k, data=data.astype("<f8" if how == "float64" else ">f4"))
    elif how == "huge":
        g.create_dataset(k, shape=(HUGE,), dtype="<f4", chunks=(1 << 16,))
    elif how == "scalar":
        g.create_dataset(k, data=np.float32(1.0))


def _extra(f: h5py.File, how: str, size: int = 0) -> None:
    """``size``: the bytes of a variable-length attribute, or the depth of nested groups."""
    if how == "vlen-format":
        f.attrs["format"] = "boinc-dl-weights" + "x" * (4 << 20) + "x" * size  # over the 4 MB bound
    elif how == "vlen-metrics":
        f.attrs["metrics"] = '{"pad": "' + "x" * (1 << 20) + "x" * size + '"}'  # over the 1 MB bound
    elif how == "vlen-job":
        f.attrs["job"] = "j"  # rewritten, within its bound: still valid
    elif how == "nested-groups":
        gid = f.require_group("optimizer" if "optimizer" not in f else "optimizer").id
        for _ in range(max(1, size)):
            gid = h5py.h5g.create(gid, b"n")
    elif how == "root-attr":
        f.attrs["extra"] = 1
    elif how == "root-dataset":
        f.create_dataset("extra", data=np.zeros(2))
    elif how == "tensor-attr":
        (f["flat"] if "flat" in f else f["tensors"]["000000"]).attrs["more"] = "x"
    elif how.startswith("optimizer") and "optimizer" not in f:
        og = f.create_group("optimizer")
        og.attrs["kind"] = "adam"
        if how == "optimizer-ok":
            og.create_dataset("000000", data=np.zeros(FP.n_params, np.float32))
        elif how == "optimizer-huge":
            og.create_dataset("000000", shape=(HUGE,), dtype="<f4", chunks=(1 << 16,))
        else:
            og.create_dataset("000000", data="text")
    elif how == "metrics-deep":
        f.attrs["metrics"] = "[" * 5000 + "]" * 5000
    elif how == "unit-array":
        f.attrs["unit"] = np.arange(3)


@READER_FUZZ
@given(data=st.data())
def test_reader_fuzz_accepts_only_benign_structures(tmp_path_factory, data) -> None:
    """Valid files (both format versions) mutated structurally (storage, links, filters,
    sizes, dtypes, extra objects, superblock/user block): the reader accepts exactly the benign mutations,
    rejects every other with WeightsFormatError, fast, and never returns server bytes."""
    d = tmp_path_factory.mktemp("rf")
    secret, secret_h5 = secret_files(d / "server", 4 * FP.n_params)
    path = d / "w.h5"
    version = data.draw(st.sampled_from([1, 2]))  # hosts of this release and of the earlier one
    valid(path, FP, "j", "u", version=version)
    last = len(FP.tensors) - 1 if version == 1 else 0  # a version-2 file holds one dataset
    tensor_muts = data.draw(st.dictionaries(st.integers(0, last), st.sampled_from(_REPLACEMENTS), max_size=2))
    extras = data.draw(st.lists(st.sampled_from(_EXTRAS), max_size=2, unique=True))
    # Dimensions of what HDF5 itself reads: bytes beyond an attribute's bound, and depth.
    size = data.draw(st.one_of(st.integers(1, 64), st.integers(1, 3000)))
    with h5py.File(path, "a") as f:
        for i, how in tensor_muts.items():
            _mutate_tensor(f, i, how, secret, secret_h5)
        for how in extras:
            try:
                if (how.startswith("optimizer") or how == "nested-groups") and "optimizer" in f:
                    extras = [x for x in extras if x != how]  # one optimizer group: the first drawn
                    continue
                _extra(f, how, size)
            except (RuntimeError, KeyError):  # e.g. an attribute on a tensor now a link loop
                extras = [x for x in extras if x != how]
    file_level = data.draw(st.sampled_from(["none", "none", "none", "userblock", "truncate", "flip",
                                            "vlen-length-lie"]))
    if file_level == "vlen-length-lie":
        # The format attribute declares far more than its heap object holds (checksum re-sealed).
        set_vlen_length(path, "format", data.draw(st.sampled_from([(4 << 20) + 1, 1 << 30, 0xFFFFFFFF])))
    raw = bytearray(path.read_bytes())
    if file_level == "userblock":
        raw = bytearray(512) + raw
    elif file_level == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif file_level == "flip":
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    path.write_bytes(bytes(raw))
    benign = (set(tensor_muts.values()) <= _BENIGN and set(extras) <= _BENIGN_EXTRAS
              and file_level in ("none",))
    t0 = time.perf_counter()
    try:
        wf = read_weights(path, FP, max_bytes=16 << 20)
    except WeightsFormatError:
        assert not benign, (tensor_muts, extras, file_level)
    else:
        assert benign or file_level == "flip", (tensor_muts, extras, file_level)
        assert wf.flat.size == FP.n_params and not np.isin(_secret_floats(), wf.flat).any()
    assert time.perf_counter() - t0 < 1.0


def test_host_metrics_are_typed_in_the_merge_record(tiny_job, tmp_path: Path) -> None:
    store, spec, _fp = tiny_job
    metrics = b'{"val_acc": "NaN please", "val_loss": [1, 2], "train_loss": 1e999, "train_acc": ' + b"9" * 400 + \
        b', "wall_s": 3.5, "host": {"x": 1}}'
    assert assimilate_files(store, _result(tmp_path / "r", metrics=metrics), spec, unit="u0").status == "merged"
    rec = store.assimilated()["u0"]
    assert [rec[k] for k in ("val_acc", "val_loss", "train_loss", "train_acc", "wall_s", "host")] == \
        [None, None, None, None, 3.5, None]


# ---- what HDF5 itself reads: the classes of issue #28, cost measured ---------------------------

_COST_PROBE = (
    "import sys, time\n"
    "from boinc_dl.server.common.weights import read_weights\n"
    "from tests.conftest import tiny_fingerprint\n"
    "def kib(k):\n"
    "    return next(int(x.split()[1]) for x in open('/proc/self/status') if x.startswith(k + ':'))\n"
    "fp = tiny_fingerprint()\n"
    "open('/proc/self/clear_refs', 'w').write('5')\n"
    "before = kib('VmRSS')\n"
    "t0 = time.perf_counter()\n"
    "try:\n    read_weights(sys.argv[1], fp, max_bytes=1 << 30)\n    print('ACCEPTED')\n"
    "except Exception as e:\n    print(type(e).__name__, str(e).replace(chr(10), ' ')[:200])\n"
    "print(time.perf_counter() - t0, kib('VmHWM') - before)\n"
)


@pytest.mark.parametrize(("name", "build", "reason"), [
    ("vlen-format-64mb", vlen_attribute(64 << 20), "'format' is over 4194304 bytes"),
    ("vlen-metrics-64mb", vlen_attribute(64 << 20, "metrics"), "'metrics' is over 1048576 bytes"),
    ("vlen-length-lie-4gb", vlen_length_lie(0xF0000000, dense=False), "4026531840 declared"),
    ("vlen-length-lie-4gb-dense", vlen_length_lie(0xF0000000, dense=True), "4026531840 declared"),
    ("heap-collection-64mb", huge_heap_collection(64 << 20), "global heap collection"),
    ("deep-groups-20000", deep_groups(20_000), "group where a dataset belongs"),
    ("wide-group-20000", wide_group(20_000), "holds 20000 objects"),
])
def test_what_hdf5_reads_is_bounded(tmp_path: Path, name: str, build, reason: str) -> None:  # noqa: ANN001
    """Each class of issue #28, in a fresh process under an upload bound that lets it
    reach the reader (1 GiB): refused with its reason in < 0.5 s, the resident set
    growing by < 16 MB (before: 7 s and 2.2 GB for a 400 MB attribute, 3.8 GB for a
    4 GB length lie in a 7 KB file, minutes for depth 20 000)."""
    path = tmp_path / "weights_out.h5"
    build(path, FP, "j", "u", tmp_path / "server")
    out = subprocess.run([sys.executable, "-c", _COST_PROBE, str(path)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True).stdout.splitlines()
    assert out[0].startswith("WeightsFormatError") and reason in out[0], out
    took, grew_kib = float(out[1].split()[0]), int(out[1].split()[1])
    assert took < 0.5, (name, took)
    assert grew_kib < 16 << 10, (name, f"peak RSS grew by {grew_kib} KiB")


def test_upload_bound_follows_the_model_unless_the_spec_sets_one(tiny_job, tmp_path: Path) -> None:
    store, spec, fp = tiny_job
    derived = upload_bound(fp)
    assert spec.units.max_upload_bytes is None
    assert derived == 16 * fp.n_params + 1024 * len(fp.tensors) + (16 << 20)
    paths = _result(tmp_path / "r")
    with Path(paths[0]).open("ab") as f:  # a valid file padded past the derived bound
        f.truncate(derived + 1)
    with pytest.raises(ResultRejected, match=f"over the {derived}-byte bound"):
        validate(paths, store, None, "u0")
    with pytest.raises(ResultRejected, match="over the 1000-byte bound"):
        validate(paths, store, 1000, "u0")  # an explicit value wins, smaller
    # Or larger: the file reaches the reader, which reads its data and never the padding.
    assert validate(paths, store, derived + (1 << 20), "u0").weights.flat.size == fp.n_params


def test_duplicated_and_out_of_range_host_metrics(tiny_job, tmp_path: Path) -> None:
    """The duplicated ``val_acc: 99.0`` of issue #28 is refused; a lone 99.0 is stored as null."""
    store, spec, _fp = tiny_job
    out = assimilate_files(store, _result(tmp_path / "d", metrics=b'{"val_acc": 0.5, "val_acc": 99.0}'), spec,
                           unit="u0")
    assert out.status == "rejected" and "duplicate key 'val_acc'" in out.reason
    out = assimilate_files(store, _result(tmp_path / "r", unit="u1", metrics=b'{"val_acc": 99.0, "val_loss": -1}'),
                           spec, unit="u1")
    assert out.status == "merged", out
    rec = store.assimilated()["u1"]
    assert rec["val_acc"] is None and rec["val_loss"] is None


def test_metrics_attribute_with_a_duplicate_key_is_refused(tmp_path: Path) -> None:
    valid(tmp_path / "w.h5", FP, "j", "u")
    with h5py.File(tmp_path / "w.h5", "a") as f:
        f.attrs["metrics"] = '{"val_acc": 0.5, "val_acc": 99.0}'
    with pytest.raises(WeightsFormatError, match="duplicate key"):
        read_weights(tmp_path / "w.h5", FP)


def test_json_depth_is_one_constant() -> None:
    assert bounded.MAX_JSON_DEPTH == 16
    nested = "[" * bounded.MAX_JSON_DEPTH + "]" * bounded.MAX_JSON_DEPTH
    assert bounded.loads(nested) is not None
    with pytest.raises(bounded.BoundExceeded):
        bounded.loads("[" + nested + "]")


def test_attribute_descriptor_search_sees_every_copy() -> None:
    """A decoy message with a small length beside the real one cannot hide it."""
    def message(length: int) -> bytes:
        name = b"format\0"
        dt = bytes([0x19, 0x01, 0, 0]) + (16).to_bytes(4, "little") + bytes([0x13, 0, 0, 0, 1, 0, 0, 0])
        ds = bytes([2, 0, 0, 0])  # version 2, scalar
        head = bytes([3, 0]) + len(name).to_bytes(2, "little") + len(dt).to_bytes(2, "little") \
            + len(ds).to_bytes(2, "little") + bytes([0])
        return head + name + dt + ds + length.to_bytes(4, "little") + bytes(12)

    assert h5bounds.vlen_bytes(b"junk" + message(16) + b"junk", "format") == 16
    assert h5bounds.vlen_bytes(message(16) + message(1 << 30), "format") == 1 << 30
    with pytest.raises(h5bounds.UncheckableAttribute):
        h5bounds.vlen_bytes(b"no message here", "format")
    with pytest.raises(h5bounds.UncheckableAttribute):  # a shared datatype: refused, never trusted
        h5bounds.vlen_bytes(bytes([3, 1]) + message(16)[2:], "format")
