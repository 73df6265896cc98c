"""The machine's MariaDB for tests that need BOINC's database: a database of the test
session's own, dropped at the end; tests skip, saying why, when none answers."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import pytest

#: The machine's MariaDB, on loopback: no TLS (PyMySQL would build a TLS context per connection).
MARIADB = {"host": "127.0.0.1", "port": 3306, "user": "root", "password": "", "ssl_disabled": True}


def mariadb_or_skip() -> Any:
    """A pymysql connection (autocommit) to the machine's MariaDB, or skip the test."""
    try:
        import pymysql

        return pymysql.connect(**MARIADB, connect_timeout=3, autocommit=True)
    except Exception as e:  # noqa: BLE001 - any reason means "not available here"
        pytest.skip(f"BOINC's database needs MariaDB on 127.0.0.1:3306 (root, no password): {e}")


def session_database(prefix: str) -> Iterator[str]:
    """Create a uniquely named database, yield its name, drop it (a fixture's body)."""
    conn = mariadb_or_skip()
    name = f"{prefix}_{os.getpid()}_{os.urandom(4).hex()}"
    with conn.cursor() as c:
        c.execute(f"CREATE DATABASE `{name}`")
    try:
        yield name
    finally:
        with conn.cursor() as c:
            c.execute(f"DROP DATABASE IF EXISTS `{name}`")
        conn.close()


def point_project_at(project: Any, db_name: str) -> None:
    """Make a BOINC project's config.xml name database ``db_name`` of the machine's MariaDB."""
    text = project.config_xml.read_text()
    for tag, value in (("db_name", db_name), ("db_host", MARIADB["host"]), ("db_user", MARIADB["user"]),
                       ("db_passwd", MARIADB["password"])):
        text = re.sub(rf"<{tag}>.*?</{tag}>", f"<{tag}>{value}</{tag}>", text)
    if "<db_port>" not in text:
        text = text.replace("</db_passwd>", f"</db_passwd>\n    <db_port>{MARIADB['port']}</db_port>", 1)
    project.config_xml.write_text(text)
    project.__dict__.pop("config", None)  # BoincProject caches the parsed config
