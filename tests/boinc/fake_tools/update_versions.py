"""Fake ``bin/update_versions [--noconfirm] [--verbose]`` (tools/update_versions): every
directory under apps/ must be an app in the database, each version directory's platform
one xadd added (once the fake database records platforms); each new version is recorded."""

import sys
import time
import xml.etree.ElementTree as ET

import _fakemysql
from _fakelib import PROJECT, database, die, record


def version_num(v):
    """tools/update_versions' parse_version: "1.0" -> 100, "2" -> 2."""
    major, _, minor = v.partition(".")
    return int(minor) + 100 * int(major) if minor else int(major)


def register_in_mariadb(app, ver, plat):
    """Insert the app_version row as the real tool does (skipped if present); the app and
    the platform must be in the database already (xadd), else "no such platform"."""
    platform, _, plan = plat.partition("__")
    conn = _fakemysql.connect(PROJECT)
    with conn.cursor() as c:
        c.execute("SELECT id FROM app WHERE name = %s", (app,))
        a = c.fetchall()
        c.execute("SELECT id FROM platform WHERE name = %s", (platform,))
        p = c.fetchall()
        if not a:
            die(f"app not found: {app}")
        if not p:
            die(f"         no such platform: {platform}")
        c.execute("SELECT id FROM app_version WHERE appid = %s AND version_num = %s AND platformid = %s "
                  "AND plan_class = %s", (a[0]["id"], version_num(ver), p[0]["id"], plan))
        if not c.fetchall():
            c.execute("INSERT INTO app_version (create_time, appid, version_num, platformid, plan_class) "
                      "VALUES (%s, %s, %s, %s, %s)", (int(time.time()), a[0]["id"], version_num(ver), p[0]["id"], plan))
    conn.close()


record("update_versions")
for a in sys.argv[1:]:
    if a not in ("--noconfirm", "--verbose"):
        die(f"unknown arg {a}")
with database() as db:
    for app in sorted((PROJECT / "apps").iterdir()):
        if app.name not in db["apps"]:
            die(f"app not found: {app.name}")
        for ver in sorted(app.iterdir()):
            for plat in sorted(ver.iterdir()):
                key = f"{app.name}/{ver.name}/{plat.name}"
                if _fakemysql.enabled(PROJECT):
                    register_in_mariadb(app.name, ver.name, plat.name)
                if key in db["app_versions"]:
                    continue
                # tools/update_versions: platform name, then optional "__<plan class>";
                # an unknown platform is skipped with a message, exit status 0
                if "platforms" in db and plat.name.split("__", 1)[0] not in db["platforms"]:
                    print(f"         no such platform: {plat.name.split('__', 1)[0]}")
                    continue
                vx = ET.parse(plat / "version.xml").getroot()
                mains = [f for f in vx.findall("file") if f.find("main_program") is not None]
                if len(mains) != 1:
                    die("exactly one main program needed")
                for f in vx.findall("file"):
                    if not (plat / f.findtext("physical_name").strip()).is_file():
                        die(f"File {f.findtext('physical_name')} is listed in version.xml but not present")
                db["app_versions"].append(key)
                print(f"    App version added successfully; {key}")
