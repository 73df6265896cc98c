"""The BOINC side of an early re-issue, through the fake BOINC project: a GCP spot VM is
preempted, the controller files the units BOINC's database shows on its host, and the
work generator daemon's next pass cancels that workunit and creates ``<unit>_r1`` from
the freshest weights, long before the unit's deadline; once, not twice."""

from __future__ import annotations

import time

from google.auth.credentials import AnonymousCredentials

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.boinc.daemon import WorkGeneratorDaemon
from boinc_dl.server.backends.boinc.submit import submit_job
from boinc_dl.server.common.spec import parse_spec
from boinc_dl.server.fleet.controller import FleetController
from boinc_dl.server.fleet.gcp import GcpProvider
from boinc_dl.server.fleet.state import FleetState
from tests.boinc.conftest import REPO, calls, fake_db
from tests.boinc.test_end_to_end import install_with_wrapper
from tests.fleet.conftest import FleetBoincDB, boinc_hosts
from tests.fleet.gcp_standin import GcpStandin, World
from tests.fleet.test_gcp import ZONE, gcp_config


def test_preempted_host_units_are_regenerated_now(project, redis_server, tmp_path, fleet_mariadb) -> None:
    install_with_wrapper(project, redis_server.url, tmp_path)
    spec = parse_spec({
        "name": "spotjob", "model": "models:mlp", "model_args": {"input_dim": 64, "hidden": 8, "n_classes": 10},
        "dataset": {"name": "digits"}, "training": {"epochs": 1, "batch_size": 64},
        "vcasgd": {"n_subsets": 2, "alpha": 0.5, "window": 2, "reissue": "fresh"},
        "units": {"timeout_s": 7200, "max_error_results": 2, "max_total_results": 4}, "seed": 3})
    submit_job(spec, project.root, search_path=REPO / "examples")
    store = JobStore(connect(redis_server.url), spec.name)
    daemon = WorkGeneratorDaemon(project, poll_s=0.1)
    daemon.one_pass()
    wus = sorted(fake_db(project.root)["workunits"])
    assert len(wus) == 2 and set(store.unit_states().values()) == {"in_progress"}

    w = World("bdl-test", ZONE, clock=lambda: time.time() - 120)  # VMs up for two minutes
    w.add_mig("bdl-spot", "g2-standard-4", 2)
    w.add_mig("bdl-ondemand", "g2-standard-4", 0)
    w.clock = time.time
    vms = sorted(w.instances)
    # The hosts' side of BOINC's database (the fake project keeps its workunits in its
    # own file for the work generator; the fleet reads hosts and results from MariaDB).
    boinc_db = FleetBoincDB(fleet_mariadb)
    fake_xml = project.config_xml.read_text()
    boinc_db.point(project)
    with GcpStandin(w) as s:
        cfg = gcp_config(s.url, project=str(project.root), max_hosts=2)
        ctl = FleetController(cfg, GcpProvider(cfg.gcp, credentials=AnonymousCredentials()), boinc_hosts(project),
                              FleetState(store.r, cfg.fleet_name()))
        project.config_xml.write_text(fake_xml)  # the work generator's BOINC: the fake project's
        project.__dict__.pop("config", None)
        for vm, wu in zip(vms, wus, strict=True):  # BOINC's scheduler sent one unit to each VM
            boinc_db.send(wu, boinc_db.add_host(vm), time.time() - 60)
        assert ctl.step().reissued == []
        w.preempt(vms[0])
        t0 = time.monotonic()
        assert ctl.step().reissued == [wus[0]]
    daemon.one_pass()
    latency = time.monotonic() - t0
    db = fake_db(project.root)["workunits"]
    assert db[wus[0]]["error_mask"] & 16  # cancelled in BOINC
    assert f"{wus[0]}_r1" in db and not db[f"{wus[0]}_r1"]["error_mask"]
    assert [c["argv"] for c in calls(project.root, "cancel_jobs")] == [["--name", wus[0]]]
    assert store.unit_info(wus[0])["attempt"] == 1 and store.unit_info(wus[1]).get("attempt", 0) == 0
    assert latency < 60  # the deadline path would wait 7200 s
    daemon.one_pass()  # none twice
    assert len(calls(project.root, "cancel_jobs")) == 1
    assert sorted(fake_db(project.root)["workunits"]) == sorted([*wus, f"{wus[0]}_r1"])
