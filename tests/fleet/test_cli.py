"""``boinc-dl fleet watch|status``: one-line errors, the status the controller published."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.cli import app
from boinc_dl.server.cli.app import console
from boinc_dl.server.fleet.records import FallbackState
from boinc_dl.server.fleet.state import Commit, FleetState


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command's console reads COLUMNS once, when first imported: in a test worker,
    whichever test imported it first (one runs on a 40-column terminal) set its width.
    The status table's words are asserted, not its wrapping; error lines never wrap."""
    monkeypatch.setattr(console, "width", 200)


def test_watch_refuses_a_bad_config_in_one_line(tmp_path) -> None:
    bad = tmp_path / "fleet.yaml"
    bad.write_text("provider: azure\nproject: /p\nmax_hosts: 2\n")
    out = CliRunner().invoke(app, ["fleet", "watch", "--config", str(bad)])
    assert out.exit_code == 2 and "provider: Input should be 'aws' or 'gcp'" in out.output
    out = CliRunner().invoke(app, ["fleet", "watch", "--config", str(tmp_path / "none.yaml")])
    assert out.exit_code == 2 and "No such file" in out.output


def test_status_shows_the_last_period_and_the_durable_fallback(tmp_path, project, redis_server, monkeypatch) -> None:
    import time

    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(f"provider: gcp\nproject: {project.root}\nmax_hosts: 4\n"
                   "gcp: {project: p, zone: z, mig: m, machine_type: g2-standard-4}\n")
    monkeypatch.setenv("BDL_REDIS_URL", redis_server.url)
    out = CliRunner().invoke(app, ["fleet", "status", "--config", str(cfg)])
    assert out.exit_code != 0 and "no status of fleet m yet" in out.output
    st = FleetState(connect(redis_server.url), "m", owner="ctl-host:123")
    assert st.hold(30)[0]
    now = time.time()
    st.commit(Commit(fallback=FallbackState(True, now - 300, now - 60, "the cloud refused spot capacity "
                                                                        "(ZONE_RESOURCE_POOL_EXHAUSTED)")), 0)
    st.publish_status({"time": f"{now:.3f}", "provider": "gcp", "running": 3, "draining": 1, "desired": 4,
                       "on_demand_percent": 50, "decision_ms": "0.40",
                       "last_reasons": "falling back to 50% on-demand"}, reissued=7)
    out = CliRunner().invoke(app, ["fleet", "status", "--config", str(cfg)])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert "3 running (+1 draining), 4 desired" in text and "50%" in text and "7 units" in text
    assert "ctl-host:123" in text and "since 300 s" in text and "ZONE_RESOURCE_POOL_EXHAUSTED" in text
