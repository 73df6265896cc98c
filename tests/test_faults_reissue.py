"""VC-ASGD re-issue policy: ``same`` (BOINC's) vs ``fresh`` (regenerate from fresh weights).

Semantics under test: a regenerated unit keeps the subset's identity (its ``wu.json``
names the original unit) and is issued as ``<unit>_r<n>``; the first result merged for
the subset wins and every other one, the late original included, is a duplicate.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.local import LocalJobSystem
from boinc_dl.server.common.weights import WeightsFile, write_weights
from boinc_dl.server.common.workunit import WEIGHTS_IN, WU_JSON, Workunit
from boinc_dl.server.work_generator.prepare import prepare_job
from boinc_dl.server.work_generator.vcasgd import VCASGDWorkGenerator
from tests.support.audit import audit_job
from tests.support.harness import run_headless, small_spec
from tests.support.results import assimilate_files

from .conftest import REPO

EXAMPLES = REPO / "examples"


def _result(d: Path, store: JobStore, unit: str, base_version: int, value: float) -> list[str]:
    d.mkdir(parents=True)
    fp = store.fingerprint("0")
    flat = np.full(fp.n_params, value, np.float32)
    write_weights(d / "weights_out.h5", WeightsFile(flat, fp, job=store.job, model="0", unit=unit,
                                                     base_version=base_version))
    (d / "metrics.json").write_text(json.dumps({"unit": unit, "val_acc": 0.5}))
    return [str(d / "weights_out.h5"), str(d / "metrics.json")]


@pytest.mark.parametrize("first", ["regenerated", "original"])
def test_first_merged_result_of_a_subset_wins(tmp_path: Path, redis_server, first: str) -> None:
    spec = small_spec("regen", vcasgd={"reissue": "fresh", "window": 2})
    store = JobStore(connect(redis_server.url), spec.name)
    prepare_job(spec, store, tmp_path, search_path=EXAMPLES)
    backend = LocalJobSystem(tmp_path, redis_server.url, spec.name, workers=1, slots=2, assimilators=1)
    gen = VCASGDWorkGenerator(store, spec, tmp_path, backend)  # the job system is never started
    assert backend.reissue_policy == "fresh"
    assert gen.step()
    a, b = sorted(store.units())
    wu_a = Workunit.load(store.unit_info(a)["files"][WU_JSON])
    assert wu_a.weights_version == 0
    # Another subset merges: the server weights move on to version 1.
    assert assimilate_files(store, _result(tmp_path / "rb", store, b, 0, 1.0), spec, unit=b).status == "merged"

    made = gen.regenerate(a, 1)
    assert made is not None
    wu_r, name = made
    assert name == f"{a}_r1" and wu_r.unit == a  # issued as _r1, same identity
    assert wu_r.weights_version == 1 and Path(wu_r.files[WEIGHTS_IN]).exists()
    assert Path(wu_r.files[WU_JSON]).name == f"{a}_r1.json"
    assert Workunit.load(wu_r.files[WU_JSON]).unit == a
    info = store.unit_info(a)
    assert info["attempt"] == 1 and info["weights_version"] == 1  # a restarted generator re-submits these
    # Each unit records the window it was issued in (the merge rule's cap), kept on regeneration.
    assert info["in_flight"] == 2 and store.unit_info(b)["in_flight"] == 2
    assert "cap" not in next(m for m in store.metrics("merge") if m["unit"] == b)["merge_rule"]  # 2/2: none

    # The job system names which issue each result answers: <unit>_r1_0 and <unit>_0.
    fresh = (f"{a}_r1_0", _result(tmp_path / "fresh", store, a, 1, 3.0))
    late = (f"{a}_0", _result(tmp_path / "late", store, a, 0, 5.0))
    order = [fresh, late] if first == "regenerated" else [late, fresh]
    outs = [assimilate_files(store, paths, spec, result, unit=a).status for result, paths in order]
    assert outs == ["merged", "duplicate"]
    assert store.version("0") == 2
    rec = store.assimilated()[a]
    assert rec["base_version"] == (1 if first == "regenerated" else 0)
    assert [m["unit"] for m in store.metrics("merge")].count(a) == 1
    # Once merged, the subset is not regenerated again.
    assert gen.regenerate(a, 2) is None


def test_same_policy_regenerates_a_unit_from_its_own_inputs(tmp_path: Path, redis_server) -> None:
    """``reissue: same``: a unit the job system cannot finish (a stuck BOINC workunit) runs
    again as ``<unit>_r1`` from the weights it was issued from, not the server's newer ones."""
    spec = small_spec("regen-same", vcasgd={"reissue": "same", "window": 2})
    store = JobStore(connect(redis_server.url), spec.name)
    prepare_job(spec, store, tmp_path, search_path=EXAMPLES)
    backend = LocalJobSystem(tmp_path, redis_server.url, spec.name, workers=1, slots=2, assimilators=1)
    gen = VCASGDWorkGenerator(store, spec, tmp_path, backend)
    assert gen.step()
    a, b = sorted(store.units())
    before = dict(store.unit_info(a))
    assert assimilate_files(store, _result(tmp_path / "rb", store, b, 0, 1.0), spec, unit=b).status == "merged"
    assert store.version("0") == 1
    wu_r, name = gen.regenerate(a, 1)
    assert name == f"{a}_r1" and wu_r.unit == a
    assert wu_r.weights_version == 0 and wu_r.files[WEIGHTS_IN] == before["files"][WEIGHTS_IN]
    info = store.unit_info(a)
    assert info["attempt"] == 1 and info["weights_version"] == 0 and info["bases"]["1"][0] == 0
    # its result is then measured against the base it really started from
    out = assimilate_files(store, _result(tmp_path / "ra", store, a, 0, 2.0), spec, f"{name}_0", unit=a)
    assert out.status == "merged" and store.assimilated()[a]["base_version"] == 0


def test_resubmit_regenerated_only_when_still_wanted(tmp_path: Path, redis_server) -> None:
    spec = small_spec("regen2", vcasgd={"reissue": "fresh"})
    store = JobStore(connect(redis_server.url), spec.name)
    prepare_job(spec, store, tmp_path, search_path=EXAMPLES)
    backend = LocalJobSystem(tmp_path, redis_server.url, spec.name, workers=1, slots=1, assimilators=1)
    gen = VCASGDWorkGenerator(store, spec, tmp_path, backend)
    gen.step()
    (unit,) = store.units()
    wu, name = gen.regenerate(unit, 1)
    assert not backend.resubmit_regenerated(unit, wu, name)  # nobody asked for it
    assert backend.regeneration_requests() == []


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["same", "fresh"])
def test_every_unit_late_each_subset_merged_once(tmp_path: Path, redis_server, policy: str) -> None:
    """Units (1.2 s, synthetic) outlive their deadline (0.8 s): each is re-issued while the
    original still runs and comes back late. Whatever the policy, one merge per subset."""
    spec = small_spec(f"late-{policy}", vcasgd={"reissue": policy, "window": 4},
                      units={"timeout_s": 0.8, "max_error_results": 4, "max_total_results": 8})
    regenerated: list[tuple[str, int, int]] = []

    def spy(backend: LocalJobSystem, gen: VCASGDWorkGenerator) -> None:
        real = gen.regenerate

        def regenerate(unit: str, attempt: int):  # noqa: ANN202
            before = store.unit_info(unit)["weights_version"]
            current = store.version("0")
            made = real(unit, attempt)
            if made is not None:
                regenerated.append((made[1], before, current, made[0].weights_version))
            return made

        gen.regenerate = regenerate  # type: ignore[method-assign]

    store = JobStore(connect(redis_server.url), spec.name)
    res = run_headless(spec, tmp_path / "run", redis_server.url, search_path=EXAMPLES, on_start=spy,
                       backend_opts={"workers": 4, "slots": 2, "assimilators": 2, "synthetic_unit_s": 1.2})
    assert res.status == "done", res.reason
    b = res.backend
    audit = audit_job(store, n_subsets=4, epochs=2)
    assert audit.ok, audit.problems
    assert audit.merges == 8 and b["merged"] == 8
    assert b["timed_out"] >= 8 and b["late_results"] >= 4
    assert b["duplicates"] >= 1  # the second result of a subset, whichever it was
    if policy == "same":
        assert b["regen_requested"] == 0 and b["reissued"] >= 8
    else:
        assert b["regen_requested"] >= 8 and b["regenerated"] >= 1 and b["regen_fallback"] == 0
        assert regenerated and all(name.rsplit("_", 1)[1].startswith("r") for name, *_ in regenerated)
        # Built from the server weights of the moment, never older than the original's.
        # (Whether they are strictly fresher depends on merges landing in between: timing;
        # test_first_merged_result_of_a_subset_wins checks that case deterministically.)
        assert all(new >= current >= old for _n, old, current, new in regenerated), regenerated
        assert store.counters().get("regenerated", 0) == b["regenerated"]


@pytest.mark.slow
def test_fresh_falls_back_to_same_inputs_when_the_generator_cannot_regenerate(tmp_path: Path,
                                                                                redis_server) -> None:
    """A generator that does not answer (here: it ignores the requests) does not stall the
    job: after ``regen_grace_s`` the job system re-issues the old inputs."""
    spec = small_spec("fallback", vcasgd={"reissue": "fresh"}, training={"epochs": 1},
                      units={"timeout_s": 0.5, "max_total_results": 8})

    def deaf(backend: LocalJobSystem, gen: VCASGDWorkGenerator) -> None:
        gen.service_regenerations = lambda: 0  # the job system still asks; the generator no longer answers

    # Units of 2 s: overdue at 0.5 s, the fallback due 0.3 s later. (With 0.8 s units the
    # fallback raced the first result on a loaded machine and sometimes lost.)

    store = JobStore(connect(redis_server.url), spec.name)
    res = run_headless(spec, tmp_path / "run", redis_server.url, search_path=EXAMPLES, on_start=deaf,
                       backend_opts={"synthetic_unit_s": 2.0, "regen_grace_s": 0.3})
    assert res.status == "done", res.reason
    assert res.backend["regen_fallback"] >= 1 and res.backend["regenerated"] == 0
    audit = audit_job(store, n_subsets=4, epochs=1)
    assert audit.ok, audit.problems
