"""A Redis's persistence settings checked against what boinc-dl's durability needs, on real
servers set up each way; ``boinc-dl redis check`` and ``sync-aof`` as a user runs them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.persistence import (
    RECOMMENDED,
    check_node,
    check_persistence,
    findings,
    read_settings,
)
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis, LocalRedisCluster
from boinc_dl.server.cli import app

REPO = Path(__file__).resolve().parents[1]


def _findings(tmp_path: Path, **kw) -> list:
    with EmbeddedRedis(tmp_path / "r", **kw) as srv:
        return check_persistence(connect(srv.url))


def test_boinc_dls_own_settings_pass_with_a_note_about_the_sync(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "r") as srv:
        settings = read_settings(connect(srv.url))
    found = findings(settings)
    (node, s), = settings.items()
    assert s["appendonly"] == "yes" and s["appendfsync"] == "no"
    assert s["dir"] == str(tmp_path / "r")
    assert [f.severity for f in found] == ["note"]
    assert f"boinc-dl redis sync-aof {tmp_path / 'r'}" in found[0].message  # the admin's next step, ready to paste


def test_everysec_is_an_error(tmp_path: Path) -> None:
    found = _findings(tmp_path, appendfsync="everysec")
    assert [f.severity for f in found] == ["error"]
    assert "everysec" in found[0].message and "sync-aof" in found[0].message


def test_always_is_clean(tmp_path: Path) -> None:
    assert _findings(tmp_path, appendfsync="always") == []


def test_no_aof_and_redis_rewrite_defaults(tmp_path: Path) -> None:
    found = _findings(tmp_path, appendfsync="everysec", extra_args=[
        "--appendonly", "no", "--auto-aof-rewrite-percentage", "100", "--auto-aof-rewrite-min-size", "64mb"])
    # Everything at once: the admin fixes it in one round.
    assert [f.severity for f in found] == ["error", "error", "note"]
    assert "appendonly no" in found[0].message
    assert "100%" in found[2].message and "64 MB" in found[2].message


def test_a_redis_that_hides_config_gives_a_warning_not_a_crash(tmp_path: Path) -> None:
    found = _findings(tmp_path, extra_args=["--rename-command", "CONFIG", ""])
    assert [f.severity for f in found] == ["warning"]
    assert "could not read" in found[0].message and "check by hand" in found[0].message


def test_bad_values_are_not_trusted_to_parse() -> None:
    s = {"appendonly": "yes", "appendfsync": "always", "auto-aof-rewrite-percentage": "lots",
         "auto-aof-rewrite-min-size": "", "dir": "/d"}
    assert check_node("n", s) == []
    assert check_node("n", {})[0].severity == "error"  # nothing known: no AOF assumed


def test_every_cluster_master_is_checked(tmp_path: Path) -> None:
    with LocalRedisCluster(tmp_path / "cluster", masters=3) as cl:
        found = check_persistence(connect(cl.url))
    assert len({f.node for f in found}) == 3
    assert {f.severity for f in found} == {"note"}


def test_the_docker_stacks_redis_has_boinc_dls_settings() -> None:
    conf = dict(line.split(None, 1) for line in (REPO / "docker/redis/redis.conf").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#"))
    for key, value in RECOMMENDED.items():
        assert conf[key].strip() == value, key


# ---- the command line --------------------------------------------------------------------

def test_check_command_fails_on_a_redis_that_can_lose_merges(tmp_path: Path) -> None:
    runner = CliRunner()
    with EmbeddedRedis(tmp_path / "bad", appendfsync="everysec") as bad, EmbeddedRedis(tmp_path / "ok") as ok:
        res_bad = runner.invoke(app, ["redis", "check", "--redis-url", bad.url])
        res_ok = runner.invoke(app, ["redis", "check"], env={"BDL_REDIS_URL": ok.url})
    assert res_bad.exit_code == 1, res_bad.output
    assert "everysec" in res_bad.output and "error" in res_bad.output
    assert res_ok.exit_code == 0, res_ok.output
    assert "appendfsync" in res_ok.output and "note" in res_ok.output


def test_check_command_needs_a_redis() -> None:
    res = CliRunner().invoke(app, ["redis", "check"], env={"BDL_REDIS_URL": ""})
    assert res.exit_code != 0 and "--redis-url" in res.output


def test_sync_aof_runs_until_sigterm_and_syncs_once_more(tmp_path: Path) -> None:
    parts = tmp_path / "appendonlydir"
    parts.mkdir()
    (parts / "appendonly.aof.1.incr.aof").write_bytes(b"*1\r\n$4\r\nPING\r\n")
    p = subprocess.Popen([sys.executable, "-m", "boinc_dl.server.cli", "redis", "sync-aof", str(tmp_path),
                          "--interval", "0.1"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env={**os.environ, "COLUMNS": "200"})
    try:
        # its first line says it runs (a fixed sleep lost the race to a slow start under load)
        first = p.stdout.readline()
        assert "syncing the AOF" in first, first + p.stdout.read()
        time.sleep(1.5)
        assert p.poll() is None  # it keeps running: a service
        p.send_signal(signal.SIGTERM)
        rest, _ = p.communicate(timeout=30)
        out = first + rest
    finally:
        p.kill()
    assert p.returncode == 0, out
    assert "1 file(s) now" in out
    passes = int(out.split("stopped after ")[1].split()[0])
    assert passes >= 5  # about one per 0.1 s, and the last one after the signal


def test_sync_aof_refuses_a_missing_dir(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["redis", "sync-aof", str(tmp_path / "nope")])
    assert res.exit_code != 0 and "not a directory" in res.output


def test_check_shows_each_jobs_merge_log_and_snapshot_truncates_it(tmp_path: Path, monkeypatch) -> None:
    """A job with logged merges: ``check`` says how many merges a crash would replay and
    from how many GB of retained inputs; ``snapshot`` takes one and empties the log."""
    from tests.test_merge_log import merge_file, new_job, result_file

    monkeypatch.setenv("BDL_SHARD_BYTES", "2000")
    monkeypatch.setenv("BDL_SNAPSHOT_EVERY", "1000")
    runner = CliRunner()
    with EmbeddedRedis(tmp_path / "r") as srv:
        store = new_job(srv.url, tmp_path / "job", units=3)
        for i in range(3):
            assert merge_file(store, result_file(tmp_path / "res", "lj", f"u{i}", i), f"u{i}") == "merged"
        res = runner.invoke(app, ["redis", "check", "--redis-url", srv.url], env={"COLUMNS": "250"})
        assert res.exit_code == 0, res.output
        row = next(line for line in res.output.splitlines() if " lj " in line)
        assert " 3 " in row and "none yet" in row
        assert "a crash of Redis costs the rebuild" in " ".join(res.output.split())  # wrapped at any width
        res = runner.invoke(app, ["redis", "snapshot", "--redis-url", srv.url, "--job", "lj"])
        assert res.exit_code == 0 and "lj/0: snapshot at shard versions 3..3" in res.output, res.output
        assert store.r.hlen(store.mlog_key("0")) == 0
        res = runner.invoke(app, ["redis", "check", "--redis-url", srv.url], env={"COLUMNS": "250"})
        row = next(line for line in res.output.splitlines() if " lj " in line)
        assert " 0 " in row and "min ago" in row


def test_check_fails_where_scripts_cannot_call_info(tmp_path: Path) -> None:
    """The shard scripts read the server's run id with INFO: a Redis that renames INFO away
    (as some managed ones do) would fail every merge, and the installed ``boinc-dl redis
    check`` says so with exit 1; a Redis with INFO passes that check."""
    with EmbeddedRedis(tmp_path / "r", appendfsync="always", extra_args=["--rename-command", "INFO", ""]) as srv:
        r = connect(srv.url)
        found = check_persistence(r)
        res = subprocess.run([sys.executable, "-m", "boinc_dl.server.cli", "redis", "check", "--redis-url", srv.url],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert [f.severity for f in found] == ["error"], found
    assert "cannot call INFO" in found[0].message
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "cannot call INFO" in res.stdout and "Traceback" not in res.stderr
    assert _findings(tmp_path / "ok", appendfsync="always") == []


def test_data_dir_is_redis_own_directory_and_none_when_redis_is_gone(tmp_path: Path) -> None:
    from boinc_dl.server.assimilator.persistence import data_dir

    with EmbeddedRedis(tmp_path / "r") as srv:
        client = connect(srv.url)
        assert data_dir(client) == str(tmp_path / "r")
    assert data_dir(client) is None  # stopped: best effort, never an exception
