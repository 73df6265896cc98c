"""``boinc-dl fleet watch|status``: one-line errors, the status the controller published."""

from __future__ import annotations

from typer.testing import CliRunner

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.cli import app
from boinc_dl.server.fleet.controller import STATUS_KEY


def test_watch_refuses_a_bad_config_in_one_line(tmp_path) -> None:
    bad = tmp_path / "fleet.yaml"
    bad.write_text("provider: azure\nproject: /p\nmax_hosts: 2\n")
    out = CliRunner().invoke(app, ["fleet", "watch", "--config", str(bad)])
    assert out.exit_code == 2 and "provider: Input should be 'aws' or 'gcp'" in out.output
    out = CliRunner().invoke(app, ["fleet", "watch", "--config", str(tmp_path / "none.yaml")])
    assert out.exit_code == 2 and "No such file" in out.output


def test_status_shows_the_last_period(tmp_path, project, redis_server, monkeypatch) -> None:
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(f"provider: gcp\nproject: {project.root}\nmax_hosts: 4\n"
                   "gcp: {project: p, zone: z, mig: m, machine_type: g2-standard-4}\n")
    monkeypatch.setenv("BDL_REDIS_URL", redis_server.url)
    out = CliRunner().invoke(app, ["fleet", "status", "--config", str(cfg)])
    assert out.exit_code != 0 and "no fleet status yet" in out.output
    connect(redis_server.url).hset(STATUS_KEY, mapping={
        "time": "0", "provider": "gcp", "running": 3, "desired": 4, "on_demand_percent": 50,
        "fallback": "the cloud refused spot capacity (ZONE_RESOURCE_POOL_EXHAUSTED)", "reissued_total": 7,
        "decision_ms": "0.40", "last_reasons": "falling back to 50% on-demand"})
    out = CliRunner().invoke(app, ["fleet", "status", "--config", str(cfg)])
    assert out.exit_code == 0, out.output
    assert "3 running, 4 desired" in out.output and "50%" in out.output and "7 units" in out.output
