"""Fake ``bin/xadd``: adds project.xml's platforms and apps to the fake database (tools/xadd).

The real one is PHP (``#!/usr/bin/env php``) and reads project.xml with
``simplexml_load_file``: without PHP's XML extension it dies with a fatal error before
touching the database. ``<project>/fake_xadd_fails`` plays that. With
``<project>/fake_mariadb`` the platforms and apps also go into MariaDB's ``platform``
and ``app`` tables, as the real tool inserts them (skipping names already there).
"""

import sys
import time
import xml.etree.ElementTree as ET

import _fakemysql
from _fakelib import PROJECT, database, record

record("xadd")
if (PROJECT / "fake_xadd_fails").exists():
    sys.stdout.write("PHP Fatal error:  Uncaught Error: Call to undefined function simplexml_load_file() "
                     "in /project/bin/xadd:25\n")
    sys.exit(255)
root = ET.parse(PROJECT / "project.xml").getroot()
with database() as db:
    platforms = db.setdefault("platforms", [])
    for pl in root.findall("platform"):
        name = pl.findtext("name").strip()
        if name not in platforms:
            platforms.append(name)
            print(f"added platform: {name}")
    for app in root.findall("app"):
        name = app.findtext("name").strip()
        if name not in db["apps"]:
            db["apps"].append(name)
            print(f"added app: {name}")
        else:
            print(f"app {name} already in DB")
if _fakemysql.enabled(PROJECT):
    conn = _fakemysql.connect(PROJECT)
    with conn.cursor() as c:
        for table, tag in (("platform", "platform"), ("app", "app")):
            for el in root.findall(tag):
                name = el.findtext("name").strip()
                c.execute(f"SELECT id FROM {table} WHERE name = %s", (name,))
                if not c.fetchall():
                    c.execute(f"INSERT INTO {table} (create_time, name, user_friendly_name) VALUES (%s, %s, %s)",
                              (int(time.time()), name, (el.findtext("user_friendly_name") or name).strip()))
    conn.close()
