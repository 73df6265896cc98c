"""Fake ``bin/update_versions [--noconfirm] [--verbose]`` (tools/update_versions): every
directory under apps/ must be an app in the database, each version directory's platform
one xadd added (once the fake database records platforms); each new version is recorded."""

import sys
import xml.etree.ElementTree as ET

from _fakelib import PROJECT, database, die, record

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
