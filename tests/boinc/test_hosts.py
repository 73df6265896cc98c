"""VC-ASGD's window on BOINC sized from the host table (real MariaDB, BOINC's column names)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from boinc_dl.server.backends.base import JobSystem
from boinc_dl.server.backends.boinc.boincdb import HostRow
from boinc_dl.server.backends.boinc.hosts import (
    HostCensus,
    active_seconds,
    active_window,
    db_params,
)
from boinc_dl.server.backends.boinc.project import BoincProject
from tests.support.mariadb import MARIADB

pymysql = pytest.importorskip("pymysql")


@pytest.fixture
def boinc_db():
    """A throw-away database with BOINC's ``host`` table (the columns read here)."""
    try:
        conn = pymysql.connect(**MARIADB, autocommit=True)
    except pymysql.err.OperationalError as e:
        pytest.skip(f"MariaDB not reachable on 127.0.0.1:3306: {e}")
    name = f"bdl_hosts_{uuid.uuid4().hex[:10]}"
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name}")
        cur.execute(f"CREATE TABLE {name}.host (id integer not null auto_increment primary key, "
                    "create_time integer not null, rpc_time integer not null, p_ncpus integer not null, "
                    "p_fpops double not null default 0, "
                    "domain_name varchar(254) not null default '')")
    try:
        yield conn, name
    finally:
        with conn.cursor() as cur:
            cur.execute(f"DROP DATABASE {name}")
        conn.close()


def _point_config_at(project: BoincProject, db: str, next_rpc_delay: int | None) -> BoincProject:
    text = project.config_xml.read_text()
    text = (text.replace("<db_name>testproj</db_name>", f"<db_name>{db}</db_name>")
            .replace("<db_host>localhost</db_host>", "<db_host>127.0.0.1:3306</db_host>")
            .replace("<db_user>boincadm</db_user>", "<db_user>root</db_user>")
            .replace("<db_passwd>s3cret</db_passwd>", "<db_passwd></db_passwd>"))
    if next_rpc_delay:
        text = text.replace("<show_results/>", f"<show_results/>\n    <next_rpc_delay>{next_rpc_delay}</next_rpc_delay>")
    project.config_xml.write_text(text)
    return BoincProject(project.root)


def test_active_window_counts_recent_hosts_slots_and_a_spare_each() -> None:
    rows = [HostRow(i, t, n, 0.0) for i, (n, t) in enumerate([(4, 1000), (2, 990), (8, 100), (0, 1000)])]
    assert active_window(rows, 1000, 60) == (4 + 1) + (2 + 1) + (1 + 1)  # p_ncpus 0 counts as 1
    assert active_window(rows, 1000, 60, spare_per_host=0) == 7
    assert active_window(rows, 1000, 5000) == 4 + 2 + 8 + 1 + 4
    assert active_window([], 1000, 60) == 0


def test_census_reads_boinc_host_table(project, boinc_db) -> None:
    conn, name = boinc_db
    p = _point_config_at(project, name, next_rpc_delay=60)
    assert active_seconds(p) == 180
    assert db_params(p)["port"] == 3306 and db_params(p)["database"] == name
    now = int(time.time())
    with conn.cursor() as cur:
        cur.executemany(f"INSERT INTO {name}.host (create_time, rpc_time, p_ncpus) VALUES (%s, %s, %s)",
                        [(now, now - 10, 4), (now, now - 100, 2), (now, now - 3600, 16)])
    census = HostCensus(p, cache_s=0)
    assert census.window() == (4 + 1) + (2 + 1)  # the host silent for an hour is gone
    with conn.cursor() as cur:
        cur.execute(f"UPDATE {name}.host SET rpc_time = %s WHERE p_ncpus = 16", (now,))
    assert census.window() == 8 + 17
    cached = HostCensus(p, cache_s=3600)
    assert cached.window() == 25
    with conn.cursor() as cur:
        cur.execute(f"DELETE FROM {name}.host")
    assert cached.window() == 25 and HostCensus(p, cache_s=0).window() == 0


def test_census_without_database_falls_back(project, tmp_path: Path) -> None:
    text = project.config_xml.read_text().replace("<db_host>localhost</db_host>", "<db_host>127.0.0.1:1</db_host>")
    project.config_xml.write_text(text)
    assert active_seconds(BoincProject(project.root)) == 3600
    assert HostCensus(BoincProject(project.root), cache_s=0).window() is None


class _Hosts(JobSystem):
    def __init__(self, live: int | None, capacity: int | None = None):
        self.live, self.capacity = live, capacity

    def live_capacity(self) -> int | None:
        return self.live

    def submit(self, wu, limits) -> None:  # pragma: no cover - not called here
        raise AssertionError

    def cancel(self, unit: str) -> None:  # pragma: no cover - not called here
        raise AssertionError


def test_vcasgd_window_follows_hosts_bounded_by_spec() -> None:
    from boinc_dl.server.common.spec import parse_spec
    from boinc_dl.server.work_generator.vcasgd import VCASGDWorkGenerator

    def window(live, spec_window=None, capacity=None, fixed=None):
        data = {"name": "w", "mode": "vcasgd", "model": "models:mlp", "dataset": {"name": "digits", "limit": 100},
                "training": {"epochs": 1}, "vcasgd": {"n_subsets": 4, **({"window": spec_window} if spec_window else {})}}
        gen = VCASGDWorkGenerator.__new__(VCASGDWorkGenerator)
        gen.spec, gen.backend = parse_spec(data), _Hosts(live, capacity)
        gen.window = fixed or gen.spec.vcasgd.window or capacity or 8
        gen._fixed_window = fixed
        return gen.current_window()

    assert window(None) == 8                      # cannot tell: today's fixed default
    assert window(None, spec_window=3) == 3
    assert window(30) == 30                       # 30 slots asking: 30 units, not 8
    assert window(30, spec_window=12) == 12       # the spec bounds it
    assert window(30, capacity=20) == 20
    assert window(0) == 1                         # nobody active yet: one unit for the first to ask
    assert window(30, fixed=5) == 5               # an explicit window wins
