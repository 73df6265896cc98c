"""A whole job through the fake BOINC project, with real files, real Redis, real training.

The test plays BOINC: the work generator daemon creates workunits with the (fake)
``bin/create_work``; for each new workunit the test builds a slot directory with
BOINC link files to the staged inputs and to the output locations, runs the app
version's launcher there (which runs ``python -m boinc_dl.client_app``), "uploads" the outputs
into the upload hierarchy under BOINC's names, then calls the validator and the
assimilator shims as script_validator/script_assimilator would.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.boinc import artifacts
from boinc_dl.server.backends.boinc.daemon import WorkGeneratorDaemon
from boinc_dl.server.backends.boinc.host_contact import host_wait_s
from boinc_dl.server.backends.boinc.install import InstallOptions, install
from boinc_dl.server.backends.boinc.project import BoincProject, dir_hier_path
from boinc_dl.server.backends.boinc.submit import submit_job
from boinc_dl.server.common.spec import JobSpec, parse_spec
from tests.boinc.conftest import REPO, calls, fake_db, run_script, script_env


def play_boinc(project, wu: dict, seq: int, env: dict[str, str], launcher: Path) -> list[str]:
    """Run one workunit like a BOINC client would; returns the uploaded output paths."""
    result = f"{wu['name']}_{seq}"
    slot = project.root.parent / "client" / "slots" / result
    proj_dir = project.root.parent / "client" / "projects" / "boinc.example.org_test"
    slot.mkdir(parents=True)
    proj_dir.mkdir(parents=True, exist_ok=True)
    # inputs: the client downloads each file into its project dir; link files in the slot
    for logical, phys in zip(artifacts.INPUT_ORDER, wu["infiles"], strict=True):
        src = dir_hier_path(phys, project.download_dir, project.fanout)
        if not (proj_dir / phys).exists():
            shutil.copyfile(src, proj_dir / phys)
        rel = os.path.relpath(proj_dir / phys, slot)
        (slot / logical).write_text(f"<soft_link>{rel}</soft_link>\n")
    # outputs: link files to <result>_r<rand>_<i> in the client's project dir
    out_names = [f"{result}_r77_{i}" for i in range(2)]
    for logical, phys in zip(artifacts.OUTPUT_ORDER, out_names, strict=True):
        (slot / logical).write_text(f"<soft_link>{os.path.relpath(proj_dir / phys, slot)}</soft_link>\n")
    p = subprocess.run(["/bin/sh", str(launcher)], cwd=slot, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    uploaded = []
    for phys in out_names:
        dest = dir_hier_path(phys, project.upload_dir, project.fanout)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(proj_dir / phys, dest)
        uploaded.append(str(dest))
    shutil.rmtree(slot)
    return uploaded


LAUNCHER = "apps/boincdl/1.0/x86_64-pc-linux-gnu/bdl_launcher_1.0.sh"


def install_with_wrapper(project, redis_url: str, tmp_path: Path, assimilators: int = 1,  # noqa: ANN201
                         min_quorum: int | None = None):
    """``boinc-dl boinc install`` with a stand-in wrapper binary and the daemons run by
    this interpreter; returns the install report."""
    wrapper = tmp_path / "wrapper_26016_x86_64-pc-linux-gnu"
    wrapper.write_bytes(b"\x7fELF stand-in for BOINC's wrapper\n")
    quorum = {} if min_quorum is None else {"min_quorum": min_quorum}
    return install(project.root, InstallOptions(redis_url=redis_url, wrapper=wrapper, assimilators=assimilators,
                                                command=[sys.executable, "-m", "boinc_dl.server.backends.boinc"],
                                                **quorum))


def digits_mop_spec(name: str, epochs: int, limit: int, **units: float) -> JobSpec:
    """A MOP job of two MLPs on a digits subset, two partitions."""
    return parse_spec({
        "name": name, "mode": "mop", "model": "models:mlp",
        "model_args": {"input_dim": 64, "n_classes": 10},
        "dataset": {"name": "digits", "limit": limit},
        "training": {"epochs": epochs, "batch_size": 32, "learning_rate": 0.01},
        "mop": {"partitions": 2, "param_grid": {"hidden": [8, 16]}},
        "units": {"max_error_results": 2, "max_total_results": 4, **units},
        "seed": 3,
    })


def run_unit(project, wu: dict, validate: bool = True) -> list[str]:
    """Play one workunit as a client, then call the validator (optionally) and the
    assimilator shims as BOINC's daemons would; returns the uploaded output paths."""
    env = script_env()
    client_env = script_env(BDL_PYTHON=sys.executable, BDL_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3")
    paths = play_boinc(project, wu, 0, client_env, project.root / LAUNCHER)
    if validate:
        v = run_script(project.root, f"../bin/bdl_validate {' '.join(paths)}", env)
        assert v.returncode == 0, v.stderr
    a = run_script(project.root, f"../bin/bdl_assimilate {wu['id']} {' '.join(paths)}", env)
    assert a.returncode == 0, a.stderr
    return paths


def new_workunits(project, store: JobStore, timeout_s: float = 1200) -> Iterator[list[dict]]:
    """Run the work generator daemon pass by pass while the job runs; yield the workunits
    each pass created (in creation order). Fails if the job stalls."""
    daemon = WorkGeneratorDaemon(project, poll_s=0.1)
    done: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while store.meta().get("status") == "running":
        assert time.monotonic() < deadline, "job did not finish"
        daemon.one_pass()
        new = [w for n, w in sorted(fake_db(project.root)["workunits"].items(), key=lambda x: x[1]["id"])
               if n not in done]
        if not new and store.meta().get("status") == "running":
            pytest.fail(f"no workunit to run but the job is still running: {store.meta()}")
        done.update(w["name"] for w in new)
        yield new


@pytest.mark.slow
def test_job_through_fake_boinc(project, redis_server, tmp_path) -> None:
    rep = install_with_wrapper(project, redis_server.url, tmp_path, assimilators=2)
    assert not [n for n in rep.notes if "redis_url" in n]
    spec = parse_spec({
        "name": "digits-boinc", "model": "models:mlp",
        "model_args": {"input_dim": 64, "hidden": 16, "n_classes": 10},
        "dataset": {"name": "digits"},
        "training": {"epochs": 2, "batch_size": 32, "local_epochs": 1, "learning_rate": 0.01},
        "vcasgd": {"n_subsets": 4, "alpha": "e/(e+1)", "window": 3},
        "units": {"timeout_s": 120, "max_error_results": 2, "max_total_results": 4, "checkpoint_every_s": 2},
        "seed": 3,
    })
    job_dir = submit_job(spec, project.root, search_path=REPO / "examples")
    assert job_dir == project.job_dir(spec.name)
    store = JobStore(connect(redis_server.url), spec.name)
    for new in new_workunits(project, store):
        for wu in new:
            if wu["error_mask"]:
                continue
            paths = run_unit(project, wu)
            for p in paths:  # BOINC's file deleter, right after assimilation
                Path(p).unlink()
    meta = store.meta()
    assert meta["status"] == "done", meta
    epochs = store.epochs()
    assert sorted(epochs) == [1, 2]
    assert all(e["units_ok"] == 4 for e in epochs.values())
    assert epochs[2]["val_acc"] > 0.5
    assert store.version("0") == 8
    # every create_work call passed the job's deadline and retry limits
    for c in calls(project.root, "create_work"):
        argv = c["argv"]
        opts = dict(zip(argv[0::2], argv[1::2], strict=False))
        # timeout_s 120 plus the longest wait a restart imposes on a host (host_wait_s)
        deadline = str(math.ceil(120 + host_wait_s(BoincProject(project.root).config)))
        assert (opts["--delay_bound"], opts["--max_error_results"], opts["--max_total_results"]) == (deadline, "2", "4")
    wus = fake_db(project.root)["workunits"]
    assert len(wus) == 8
    # shared files staged once and reused: one model, one validation split, 4 subsets
    infiles = [w["infiles"] for w in wus.values()]
    assert len({i[0] for i in infiles}) == 1 and len({i[1] for i in infiles}) == 1
    assert len({i[2] for i in infiles}) == 4
    # the finished job left the download hierarchy clean but for the workunits' own
    # descriptions, which BOINC's file deleter removes (not <no_delete/>); kept its metrics
    assert meta["boinc_finalized"] == "1"
    left = {n for i in infiles for n in i if dir_hier_path(n, project.download_dir, project.fanout).exists()}
    assert left == {f"{name}.json" for name in wus}
    kept = sorted((job_dir / "results").iterdir())
    assert len(kept) == 8 and all(json.loads((k / "metrics.json").read_text())["unit"] == k.name for k in kept)


@pytest.mark.slow
def test_mop_job_through_fake_boinc(project, redis_server, tmp_path) -> None:
    """MOP on BOINC (pull mode): at most one unit per model exists at a time, every model
    visits every partition once per epoch, partitions are shared sticky inputs."""
    from boinc_dl.server.common.workunit import parse_unit_name

    install_with_wrapper(project, redis_server.url, tmp_path)
    spec = digits_mop_spec("digits-boinc-mop", epochs=2, limit=600, timeout_s=120, checkpoint_every_s=2)
    submit_job(spec, project.root, search_path=REPO / "examples")
    store = JobStore(connect(redis_server.url), spec.name)
    visits: dict[tuple[str, int], list[int]] = {}
    for new in new_workunits(project, store):
        models = [parse_unit_name(w["name"])["model"] for w in new]
        assert len(models) == len(set(models)), f"two units of one model in flight: {models}"
        for wu in new:
            info = parse_unit_name(wu["name"])
            visits.setdefault((info["model"], info["epoch"]), []).append(info["shard"])
            run_unit(project, wu, validate=False)
    assert store.meta()["status"] == "done", store.meta()
    assert len(visits) == 4 and all(sorted(v) == [0, 1] for v in visits.values())
    wus = fake_db(project.root)["workunits"]
    assert len(wus) == 8
    # the partition (data) file of a unit is one of 2 shared files, staged once each
    assert len({w["infiles"][2] for w in wus.values()}) == 2


@pytest.mark.slow
def test_fresh_reissue_through_fake_boinc(db_project, redis_server, tmp_path) -> None:
    """``vcasgd.reissue: fresh`` on BOINC: a workunit whose sent result passed its report
    deadline is cancelled and recreated as ``<unit>_r1`` from the freshest weights; the
    cancelled workunit's error call changes nothing; the subset is merged once."""
    from tests.boinc import fake_server

    project = db_project
    install_with_wrapper(project, redis_server.url, tmp_path)
    spec = parse_spec({
        "name": "fresh-boinc", "model": "models:mlp",
        "model_args": {"input_dim": 64, "hidden": 8, "n_classes": 10},
        "dataset": {"name": "digits"},
        "training": {"epochs": 1, "batch_size": 64, "local_epochs": 1, "learning_rate": 0.01},
        "vcasgd": {"n_subsets": 2, "alpha": 0.5, "window": 2, "reissue": "fresh"},
        "units": {"timeout_s": 1, "max_error_results": 2, "max_total_results": 3},
        "seed": 3,
    })
    submit_job(spec, project.root, search_path=REPO / "examples")
    store = JobStore(connect(redis_server.url), spec.name)
    env = script_env()
    # one active host with one CPU: the window from BOINC's hosts is its slot plus a spare
    fake_server._exec(project, "INSERT INTO host (create_time, rpc_time, p_ncpus, p_fpops) VALUES (0, %s, 1, 3e9)",
                      (int(time.time()),))
    daemon = WorkGeneratorDaemon(project, poll_s=0.1)
    daemon.one_pass()
    wus = fake_db(project.root)["workunits"]
    lost, other = sorted(wus)  # the first is lost with its host; the other one runs
    fake_server.send(project, [other])
    # sent just past its deadline (timeout_s 1 plus what a restart may make a host wait)
    fake_server.send(project, [lost], now=time.time() - wus[lost]["delay_bound"] - 1)
    run_unit(project, wus[other])
    assert store.version("0") == 1
    daemon.one_pass()
    wus = fake_db(project.root)["workunits"]
    assert wus[lost]["error_mask"] & 16  # cancelled
    assert calls(project.root, "cancel_jobs")[-1]["argv"] == ["--name", lost]
    regen = f"{lost}_r1"
    assert regen in wus and not wus[regen]["error_mask"]
    info = store.unit_info(lost)
    assert info["attempt"] == 1 and info["weights_version"] == 1  # built from the merged weights
    # BOINC reports the cancelled workunit through the assimilator's error call: ignored.
    e = run_script(project.root, f"../bin/bdl_assimilate --error 16 {lost} {wus[lost]['id']} 0", env)
    assert e.returncode == 0 and "superseded" in e.stderr + e.stdout
    assert store.unit_states()[lost] == "in_progress"
    run_unit(project, wus[regen])
    for _ in range(20):
        if store.meta().get("status") != "running":
            break
        daemon.one_pass()
    assert store.meta()["status"] == "done", store.meta()
    assert store.version("0") == 2 and store.epochs()[1]["units_ok"] == 2
    assert store.assimilated()[lost]["base_version"] == 1
    # no second regeneration: the limit of 3 workunits leaves BOINC's own re-issue the last
    assert sorted(fake_db(project.root)["workunits"]) == sorted([lost, other, regen])
