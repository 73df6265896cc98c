"""Fake ``bin/xadd``: adds project.xml's apps and platforms to the fake database (tools/xadd)."""

import xml.etree.ElementTree as ET

from _fakelib import PROJECT, database, record

record("xadd")
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
