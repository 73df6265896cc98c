"""BoincJobSystem against a fake project: the exact create_work/stage_file/cancel_jobs
command lines, staging into the download hierarchy, batching, retries of failures."""

from __future__ import annotations

import hashlib
import json
import math
import shlex
import time
from pathlib import Path

import pytest

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.base import RetryLimits
from boinc_dl.server.backends.boinc.host_contact import host_wait_s
from boinc_dl.server.backends.boinc.jobsystem import (
    BoincJobSystem,
    BoincToolError,
)
from boinc_dl.server.backends.boinc.project import BoincProject, BoincSettings, dir_hier_path
from boinc_dl.server.backends.boinc.registry import BoincRegistry
from boinc_dl.server.common.errors import BoincDLError
from boinc_dl.server.common.weights import upload_bound
from boinc_dl.server.common.workunit import Workunit, parse_unit_name
from tests.boinc.conftest import calls, fake_db, seed_db_app

LIMITS = RetryLimits(delay_bound_s=90.0, max_error_results=3, max_total_results=6)


def make_inputs(project: BoincProject, job: str, units: list[str], version: int = 0) -> list[Workunit]:
    d = project.job_dir(job) / "files"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{job}__model.keras").write_bytes(b"model" * 100)
    (d / f"{job}__val.npz").write_bytes(b"val" * 100)
    w = d / f"{job}__m0_v{version:07d}.h5"
    w.write_bytes(b"weights%d" % version * 50)
    out = []
    for u in units:
        shard = int(u.split("_s")[-1][:4])
        (d / f"{job}__shard{shard:04d}.npz").write_bytes(b"shard%d" % shard * 100)
        wu = Workunit(job=job, unit=u, mode="vcasgd", epoch=parse_unit_name(u)["epoch"], model="0", shard=shard,
                      weights_version=version, training={}, seed=1)
        (d / f"{u}.json").write_text(wu.to_json())
        wu.files = {"wu.json": str(d / f"{u}.json"), "model.keras": str(d / f"{job}__model.keras"),
                    "weights_in.h5": str(w), "data.npz": str(d / f"{job}__shard{shard:04d}.npz"),
                    "val.npz": str(d / f"{job}__val.npz")}
        out.append(wu)
    return out


@pytest.fixture
def setup(project, tiny_boinc_job, redis_server):
    from boinc_dl.server.backends.boinc.install import InstallOptions, install

    install(project.root, InstallOptions(run_db_tools=False, gpu=False))
    seed_db_app(project.root)
    store, spec = tiny_boinc_job
    r = connect(redis_server.url)
    return project, store, spec, r


def units_of(spec, n: int) -> list[str]:
    return [f"{spec.name}__m0_e0001_s{i:04d}" for i in range(n)]


def created(project: BoincProject, r, spec, n: int) -> tuple[BoincJobSystem, list[Workunit]]:
    """A job system with ``n`` units of ``spec`` submitted and created (one batch)."""
    be = BoincJobSystem(project, r)
    wus = make_inputs(project, spec.name, units_of(spec, n))
    for wu in wus:
        be.submit(wu, LIMITS)
    be.flush()
    return be, wus


def test_batched_create_work_command_line(setup) -> None:
    project, store, spec, r = setup
    be = BoincJobSystem(project, r)
    wus = make_inputs(project, spec.name, units_of(spec, 3))
    for wu in wus:
        be.submit(wu, LIMITS)
    assert be.pending() == [wu.unit for wu in wus]
    assert calls(project.root, "create_work") == []
    assert be.flush() == 3
    cw = calls(project.root, "create_work")
    assert len(cw) == 1, "one create_work call per batch"
    argv = cw[0]["argv"]
    assert cw[0]["cwd"] == str(project.root)
    opts = dict(zip(argv[0::2], argv[1::2], strict=False))
    assert opts["--appname"] == "boincdl"
    # timeout_s plus what a restart makes a host wait (install's maintenance_delay)
    deadline = be.deadline_s(LIMITS)
    assert opts["--delay_bound"] == str(deadline) == str(math.ceil(90 + host_wait_s(project.config)))
    assert deadline > 90
    assert opts["--min_quorum"] == "1" and opts["--target_nresults"] == "1"
    assert opts["--max_error_results"] == "3" and opts["--max_total_results"] == "6"
    assert opts["--max_success_results"] == "6"
    assert opts["--wu_template"] == "templates/boincdl_in"
    assert opts["--priority"] == "0"  # epoch 1 (on the command line: release 1.2 has no per-line --priority)
    # The result bound follows the model (no units.max_upload_bytes in the spec): 16 bytes
    # per parameter, 1 KiB per tensor and 16 MiB of headroom.
    fp = store.fingerprint("0")
    bound = upload_bound(fp)
    assert spec.units.max_upload_bytes is None and bound == 16 * fp.n_params + 1024 * len(fp.tensors) + (16 << 20)
    assert opts["--result_template"] == f"templates/boincdl_out_{bound}_ri"
    assert argv[-1] == "--stdin"
    lines = cw[0]["stdin"].splitlines()
    assert len(lines) == 3
    for wu, line in zip(wus, lines, strict=True):
        toks = shlex.split(line)
        assert toks[:6] == ["--wu_name", wu.unit, "--wu_template", "templates/boincdl_in",
                            "--result_template", opts["--result_template"]]
        assert toks[6:] == [Path(wu.files[n]).name for n in
                            ("model.keras", "val.npz", "data.npz", "weights_in.h5", "wu.json")]
    db = fake_db(project.root)
    assert sorted(db["workunits"]) == sorted(wu.unit for wu in wus)
    w = db["workunits"][wus[0].unit]
    assert (w["delay_bound"], w["max_error_results"], w["max_total_results"], w["min_quorum"]) == (deadline, 3, 6, 1)
    assert w["priority"] == 0
    assert be.pending() == []
    assert r.smembers(BoincRegistry(store).created_key) == {wu.unit.encode() for wu in wus}
    assert (project.root / opts["--result_template"]).is_file()


def test_staging_layout_and_once(setup) -> None:
    project, store, spec, r = setup
    be, wus = created(project, r, spec, 2)
    model = Path(wus[0].files["model.keras"])
    staged = dir_hier_path(model.name, project.download_dir, 1024)
    assert staged.read_bytes() == model.read_bytes()
    h = hashlib.md5(model.name.encode()).hexdigest()
    assert staged.parent.name == format(int(h[1:8], 16) % 1024, "x")
    md5, size = Path(f"{staged}.md5").read_text().split()
    assert md5 == hashlib.md5(model.read_bytes()).hexdigest() and int(size) == model.stat().st_size
    mtime = staged.stat().st_mtime_ns
    # a new process (restart) stages the next unit: shared files are not copied again
    be2 = BoincJobSystem(project, r)
    more = make_inputs(project, spec.name, [units_of(spec, 3)[2]])
    be2.submit(more[0], LIMITS)
    be2.flush()
    assert staged.stat().st_mtime_ns == mtime
    assert len(calls(project.root, "stage_file")) == 0  # native staging


def test_immutable_names(setup) -> None:
    project, store, spec, r = setup
    be = BoincJobSystem(project, r)
    wus = make_inputs(project, spec.name, units_of(spec, 1))
    be.submit(wus[0], LIMITS)
    be.flush()
    Path(wus[0].files["model.keras"]).write_bytes(b"other content")
    be2 = BoincJobSystem(project, r)
    wu2 = make_inputs(project, spec.name, [units_of(spec, 2)[1]])[0]
    Path(wu2.files["model.keras"]).write_bytes(b"other content")
    be2.submit(wu2, LIMITS)
    with pytest.raises(BoincToolError, match="immutable"):
        be2.flush()
    assert be2.pending() == [wu2.unit]


def test_resubmit_is_idempotent(setup) -> None:
    project, store, spec, r = setup
    be, wus = created(project, r, spec, 2)
    # a restarted generator submits the same units again: nothing reaches create_work
    be2 = BoincJobSystem(project, r)
    for wu in wus:
        be2.submit(wu, LIMITS)
    assert be2.pending() == []
    assert be2.flush() == 0
    assert len(calls(project.root, "create_work")) == 1


def test_duplicate_in_batch_falls_back_to_one_by_one(setup) -> None:
    project, store, spec, r = setup
    be = BoincJobSystem(project, r)
    wus = make_inputs(project, spec.name, units_of(spec, 3))
    be.submit(wus[0], LIMITS)
    be.flush()
    r.srem(BoincRegistry(store).created_key, wus[0].unit)  # crash after create_work, before the ledger write
    be2 = BoincJobSystem(project, r)
    for wu in wus:
        be2.submit(wu, LIMITS)
    assert be2.flush() == 3
    assert sorted(fake_db(project.root)["workunits"]) == sorted(wu.unit for wu in wus)
    assert r.smembers(BoincRegistry(store).created_key) == {wu.unit.encode() for wu in wus}


def test_create_work_failure_keeps_units_queued(setup) -> None:
    project, store, spec, r = setup
    be = BoincJobSystem(project, r)
    wus = make_inputs(project, spec.name, units_of(spec, 2))
    for wu in wus:
        be.submit(wu, LIMITS)
    (project.root / "templates" / "boincdl_in").rename(project.root / "templates" / "moved")
    with pytest.raises(BoincToolError, match=r"create_work failed \(exit 1\).*boincdl_in"):
        be.flush()
    assert be.pending() == [wu.unit for wu in wus]
    (project.root / "templates" / "moved").rename(project.root / "templates" / "boincdl_in")
    assert be.flush() == 2


def test_batch_size_flushes_automatically(setup) -> None:
    project, store, spec, r = setup
    be = BoincJobSystem(project, r, batch_size=2)
    wus = make_inputs(project, spec.name, units_of(spec, 3))
    for wu in wus:
        be.submit(wu, LIMITS)
    assert len(calls(project.root, "create_work")) == 1
    assert be.pending() == [wus[2].unit]


def test_quorum_for_volunteers_and_bad_limits(setup) -> None:
    project, store, spec, r = setup
    be = BoincJobSystem(project, r, settings=BoincSettings(min_quorum=2))
    wus = make_inputs(project, spec.name, units_of(spec, 1))
    be.submit(wus[0], LIMITS)
    be.flush()
    argv = calls(project.root, "create_work")[-1]["argv"]
    opts = dict(zip(argv[0::2], argv[1::2], strict=False))
    assert opts["--min_quorum"] == "2" and opts["--target_nresults"] == "2"
    be3 = BoincJobSystem(project, r, settings=BoincSettings(min_quorum=3))
    wu2 = make_inputs(project, spec.name, [units_of(spec, 2)[1]])[0]
    be3.submit(wu2, RetryLimits(60, 1, 2))
    with pytest.raises(BoincDLError, match="at least the quorum"):
        be3.flush()


def test_cancel(setup) -> None:
    project, store, spec, r = setup
    be = BoincJobSystem(project, r)
    wus = make_inputs(project, spec.name, units_of(spec, 2))
    be.submit(wus[0], LIMITS)
    be.flush()
    be.submit(wus[1], LIMITS)
    be.cancel(wus[1].unit)  # queued only: dropped, no tool call
    assert be.pending() == []
    be.cancel(wus[0].unit)
    cj = calls(project.root, "cancel_jobs")
    assert [c["argv"] for c in cj] == [["--name", wus[0].unit]]
    assert fake_db(project.root)["workunits"][wus[0].unit]["error_mask"] & 16
    be.cancel(wus[1].unit)  # never created: nothing to do in BOINC
    assert len(calls(project.root, "cancel_jobs")) == 1
    be.cancel("foreign_name")  # not ours, not in the ledger: "No workunit named" is a warning


def test_stage_file_mode_and_tool_runner(setup, monkeypatch, tmp_path) -> None:
    project, store, spec, r = setup
    be = BoincJobSystem(project, r, settings=BoincSettings(stage_mode="stage_file"))
    wus = make_inputs(project, spec.name, units_of(spec, 1))
    be.submit(wus[0], LIMITS)
    be.flush()
    sf = calls(project.root, "stage_file")
    assert len(sf) == 5 and all(c["argv"][0] == "--copy" and Path(c["argv"][1]).is_absolute() for c in sf)
    assert all(c["cwd"] == str(project.root) for c in sf)
    # $BDL_BOINC_TOOL_RUNNER runs the tools elsewhere: RUNNER TOOL ARGS
    log = tmp_path / "runner.log"
    runner = tmp_path / "runner"
    runner.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\ncat > /dev/null\nexit 0\n")
    runner.chmod(0o755)
    monkeypatch.setenv("BDL_BOINC_TOOL_RUNNER", str(runner))
    be2 = BoincJobSystem(project, r)
    wu2 = make_inputs(project, spec.name, [units_of(spec, 2)[1]])[0]
    be2.submit(wu2, LIMITS)
    be2.flush()
    assert log.read_text().startswith("create_work --appname boincdl ")


def test_unstage_job(setup) -> None:
    project, store, spec, r = setup
    be, wus = created(project, r, spec, 2)
    staged = [dir_hier_path(Path(p).name, project.download_dir, 1024) for p in wus[0].files.values()]
    assert all(p.exists() for p in staged)
    # model, val, 2 shards, weights; the 2 workunits' own descriptions are the file deleter's
    assert be.unstage_job(spec.name) == 5
    described = {Path(wu.files["wu.json"]).name for wu in wus}
    assert not any(p.exists() for p in staged if p.name not in described)
    assert not any(Path(f"{p}.md5").exists() for p in staged if p.name not in described)
    assert all(dir_hier_path(n, project.download_dir, 1024).exists() for n in described)


def test_bad_unit(setup) -> None:
    project, store, spec, r = setup
    be = BoincJobSystem(project, r)
    wu = make_inputs(project, spec.name, units_of(spec, 1))[0]
    del wu.files["val.npz"]
    with pytest.raises(BoincDLError, match="val.npz"):
        be.submit(wu, LIMITS)
    wu2 = make_inputs(project, spec.name, units_of(spec, 1))[0]
    wu2.unit = "bad name; rm -rf"
    with pytest.raises(BoincDLError, match="not a valid"):
        be.submit(wu2, LIMITS)
    assert json.loads(json.dumps(be.pending())) == []


def test_fresh_regeneration_requests_and_resubmit(setup, mariadb_name) -> None:
    from tests.boinc import fake_server
    from tests.boinc.conftest import use_mariadb

    project, store, spec, r = setup
    use_mariadb(project, mariadb_name)
    assert spec.vcasgd.reissue == "fresh" and spec.units.max_total_results == 6
    be = BoincJobSystem(project, r)
    (wu,) = make_inputs(project, spec.name, units_of(spec, 1))
    be.submit(wu, LIMITS)
    be.flush()
    store.transition_unit(wu.unit, "created", "in_progress")
    assert be.regeneration_requests(spec.name) == []  # never sent: not late
    key = BoincRegistry(store).issued_key
    rec = json.loads(r.hget(key, wu.unit))
    deadline = be.deadline_s(LIMITS)
    assert rec["name"] == wu.unit and rec["attempt"] == 0 and rec["delay"] == deadline
    fake_server.send(project, [wu.unit], now=time.time() - deadline - 1)  # sent just past its deadline
    assert be.regeneration_requests(spec.name) == [(wu.unit, 0)]
    assert be.regeneration_requests() == []  # no job, nothing (BOINC runs many jobs)

    (wu_r,) = make_inputs(project, spec.name, [f"{wu.unit}_r1"], version=3)
    wu_r.unit = wu.unit  # the identity stays the subset's unit
    assert be.resubmit_regenerated(wu.unit, wu_r, f"{wu.unit}_r1")
    be.flush()
    assert [c["argv"] for c in calls(project.root, "cancel_jobs")] == [["--name", wu.unit]]
    assert f"{wu.unit}_r1" in fake_db(project.root)["workunits"]
    assert BoincRegistry(JobStore(r, spec.name)).current_instance(wu.unit) == f"{wu.unit}_r1"
    assert be.regeneration_requests(spec.name) == []  # the new workunit has its own deadline
    be.cancel(wu.unit)  # cancels the current workunit, not the superseded one
    assert calls(project.root, "cancel_jobs")[-1]["argv"] == ["--name", f"{wu.unit}_r1"]

    # the last workunit max_total_results allows is left to BOINC's own re-issue
    (wu_4,) = make_inputs(project, spec.name, [f"{wu.unit}_r4"], version=4)
    wu_4.unit = wu.unit
    be.resubmit_regenerated(wu.unit, wu_4, f"{wu.unit}_r4")
    be.flush()
    fake_server.send(project, [f"{wu.unit}_r4"], now=time.time() - deadline - 1)
    assert be.regeneration_requests(spec.name) == [(wu.unit, 4)]
    r.hset(key, wu.unit, json.dumps({**json.loads(r.hget(key, wu.unit)), "attempt": 5}))
    assert be.regeneration_requests(spec.name) == []
    r.hset(key, wu.unit, json.dumps({**json.loads(r.hget(key, wu.unit)), "attempt": 4}))
    store.transition_unit(wu.unit, "in_progress", "assimilated")
    assert be.regeneration_requests(spec.name) == []  # merged meanwhile


def test_no_regeneration_without_boinc_database(setup) -> None:
    """Without BOINC's database only BOINC's own re-issue runs: a guess from creation
    times would regenerate units that merely wait in BOINC's queue."""
    project, store, spec, r = setup
    be = BoincJobSystem(project, r)
    (wu,) = make_inputs(project, spec.name, units_of(spec, 1))
    be.submit(wu, LIMITS)
    be.flush()
    store.transition_unit(wu.unit, "created", "in_progress")
    key = BoincRegistry(store).issued_key
    rec = json.loads(r.hget(key, wu.unit))
    r.hset(key, wu.unit, json.dumps({**rec, "t": rec["t"] - 1000}))
    assert be.regeneration_requests(spec.name) == []
