"""Fake ``bin/xadd``: adds project.xml's apps to the fake database (tools/xadd)."""

import xml.etree.ElementTree as ET

from _fakelib import PROJECT, database, record

record("xadd")
root = ET.parse(PROJECT / "project.xml").getroot()
with database() as db:
    for app in root.findall("app"):
        name = app.findtext("name").strip()
        if name not in db["apps"]:
            db["apps"].append(name)
            print(f"added app: {name}")
        else:
            print(f"app {name} already in DB")
