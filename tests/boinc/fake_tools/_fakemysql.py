"""The fake project's BOINC database in a real MariaDB (test double, not BOINC code).

Only the columns of BOINC's ``workunit``, ``result``, ``host``, ``platform``, ``app`` and
``app_version`` tables that boinc-dl reads (``host_app_version`` whole), with BOINC's names and meanings (``db/schema.sql``, ``db/boinc_db_types.h``).
The fake tools write here when ``<project>/fake_mariadb`` exists; the database and its
credentials are those of the project's ``config.xml``, as for BOINC's own tools.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

SCHEMA = (
    """CREATE TABLE workunit (
        id INTEGER NOT NULL AUTO_INCREMENT PRIMARY KEY,
        create_time INTEGER NOT NULL,
        appid INTEGER NOT NULL DEFAULT 1,
        name VARCHAR(254) NOT NULL UNIQUE,
        rsc_fpops_est DOUBLE NOT NULL DEFAULT 0,
        rsc_fpops_bound DOUBLE NOT NULL DEFAULT 0,
        delay_bound INTEGER NOT NULL,
        transition_time INTEGER NOT NULL DEFAULT 0,
        error_mask INTEGER NOT NULL DEFAULT 0,
        file_delete_state INTEGER NOT NULL DEFAULT 0,
        assimilate_state INTEGER NOT NULL DEFAULT 0,
        canonical_resultid INTEGER NOT NULL DEFAULT 0,
        need_validate SMALLINT NOT NULL DEFAULT 0,
        min_quorum INTEGER NOT NULL DEFAULT 1,
        target_nresults INTEGER NOT NULL DEFAULT 1,
        max_error_results INTEGER NOT NULL DEFAULT 1,
        max_total_results INTEGER NOT NULL DEFAULT 1,
        max_success_results INTEGER NOT NULL DEFAULT 1,
        priority INTEGER NOT NULL DEFAULT 0
    )""",
    """CREATE TABLE result (
        id INTEGER NOT NULL AUTO_INCREMENT PRIMARY KEY,
        create_time INTEGER NOT NULL,
        workunitid INTEGER NOT NULL,
        server_state INTEGER NOT NULL,
        outcome INTEGER NOT NULL DEFAULT 0,
        validate_state INTEGER NOT NULL DEFAULT 0,
        file_delete_state INTEGER NOT NULL DEFAULT 0,
        hostid INTEGER NOT NULL DEFAULT 0,
        userid INTEGER NOT NULL DEFAULT 0,
        appid INTEGER NOT NULL DEFAULT 1,
        app_version_id INTEGER NOT NULL DEFAULT 0,
        report_deadline INTEGER NOT NULL DEFAULT 0,
        sent_time INTEGER NOT NULL DEFAULT 0,
        received_time INTEGER NOT NULL DEFAULT 0,
        name VARCHAR(254) NOT NULL UNIQUE,
        elapsed_time DOUBLE NOT NULL DEFAULT 0,
        cpu_time DOUBLE NOT NULL DEFAULT 0,
        flops_estimate DOUBLE NOT NULL DEFAULT 0,
        priority INTEGER NOT NULL DEFAULT 0,
        KEY (workunitid)
    )""",
    """CREATE TABLE host (
        id INTEGER NOT NULL AUTO_INCREMENT PRIMARY KEY,
        create_time INTEGER NOT NULL,
        rpc_time INTEGER NOT NULL DEFAULT 0,
        domain_name VARCHAR(254) NOT NULL DEFAULT '',
        userid INTEGER NOT NULL DEFAULT 0,
        p_ncpus INTEGER NOT NULL DEFAULT 1,
        p_fpops DOUBLE NOT NULL DEFAULT 0
    )""",
    """CREATE TABLE platform (
        id INTEGER NOT NULL AUTO_INCREMENT PRIMARY KEY,
        create_time INTEGER NOT NULL,
        name VARCHAR(191) NOT NULL,
        user_friendly_name VARCHAR(254) NOT NULL,
        deprecated TINYINT NOT NULL DEFAULT 0
    )""",
    """CREATE TABLE app (
        id INTEGER NOT NULL AUTO_INCREMENT PRIMARY KEY,
        create_time INTEGER NOT NULL,
        name VARCHAR(191) NOT NULL,
        deprecated SMALLINT NOT NULL DEFAULT 0,
        user_friendly_name VARCHAR(254) NOT NULL,
        target_nresults SMALLINT NOT NULL DEFAULT 0
    )""",
    """CREATE TABLE app_version (
        id INTEGER NOT NULL AUTO_INCREMENT PRIMARY KEY,
        create_time INTEGER NOT NULL,
        appid INTEGER NOT NULL,
        version_num INTEGER NOT NULL,
        platformid INTEGER NOT NULL,
        deprecated TINYINT NOT NULL DEFAULT 0,
        plan_class VARCHAR(128) NOT NULL DEFAULT ''
    )""",
    # All of BOINC's columns (db/schema.sql) and its unique key (db/constraints.sql):
    # the scheduler creates the row, the validator counts consecutive_valid up and
    # resets it for an invalid result, and boinc-dl resets it for a refused one.
    """CREATE TABLE host_app_version (
        host_id INTEGER NOT NULL,
        app_version_id INTEGER NOT NULL,
        pfc_n DOUBLE NOT NULL DEFAULT 0,
        pfc_avg DOUBLE NOT NULL DEFAULT 0,
        et_n DOUBLE NOT NULL DEFAULT 0,
        et_avg DOUBLE NOT NULL DEFAULT 0,
        et_var DOUBLE NOT NULL DEFAULT 0,
        et_q DOUBLE NOT NULL DEFAULT 0,
        max_jobs_per_day INTEGER NOT NULL DEFAULT 0,
        n_jobs_today INTEGER NOT NULL DEFAULT 0,
        turnaround_n DOUBLE NOT NULL DEFAULT 0,
        turnaround_avg DOUBLE NOT NULL DEFAULT 0,
        turnaround_var DOUBLE NOT NULL DEFAULT 0,
        turnaround_q DOUBLE NOT NULL DEFAULT 0,
        consecutive_valid INTEGER NOT NULL DEFAULT 0,
        UNIQUE KEY hap (host_id, app_version_id)
    )""",
)
TABLES = ("workunit", "result", "host", "platform", "app", "app_version", "host_app_version")


def enabled(project: Path) -> bool:
    return (project / "fake_mariadb").exists()


def connect(project: Path):  # noqa: ANN201 - a pymysql connection
    """A read-write connection with config.xml's credentials (the fake tools own the DB)."""
    import pymysql

    cfg = ET.parse(project / "config.xml").getroot().find("config")

    def val(tag: str) -> str:
        el = cfg.find(tag) if cfg is not None else None
        return (el.text or "").strip() if el is not None else ""

    return pymysql.connect(host=val("db_host"), port=int(val("db_port") or 3306), user=val("db_user"),
                           password=val("db_passwd"), database=val("db_name"), autocommit=True,
                           connect_timeout=5, read_timeout=10, write_timeout=10, ssl_disabled=True,
                           cursorclass=pymysql.cursors.DictCursor)
