"""Fake ``bin/stage_file [--gzip] [--copy] [--verbose] path`` (tools/stage_file)."""

import gzip
import hashlib
import os
import shutil
import sys
from pathlib import Path

from _fakelib import config_value, die, hier_path, record

record("stage_file")
if not Path("html/inc/dir_hier.inc").exists() or not Path("config.xml").exists():
    die("This script must be run in the project directory.")
args = sys.argv[1:]
if not args:
    die("usage: stage_file [--gzip] [--copy] path")
flags = args[:-1]
for f in flags:
    if f not in ("--gzip", "--copy", "--verbose"):
        die("usage: stage_file [--gzip] [--copy] path")
src = Path(args[-1])
if not src.exists():
    die(f"no such file: {src}")
fanout = int(config_value("uldl_dir_fanout") or 0)
if not fanout:
    die("can't find <uldl_dir_fanout> in config.xml")
paths = [p for p in src.iterdir() if p.is_file()] if src.is_dir() else [src]
for p in paths:
    dest = hier_path(p.name, config_value("download_dir"), fanout)
    dest.parent.mkdir(parents=True, exist_ok=True)
    md5 = hashlib.md5(p.read_bytes()).hexdigest()
    if dest.exists():
        if hashlib.md5(dest.read_bytes()).hexdigest() != md5:
            die(f"Can't stage input file {p}: same name, different contents")
    elif "--copy" in flags:
        shutil.copyfile(p, dest)
    else:
        os.rename(p, dest)
    Path(f"{dest}.md5").write_text(f"{md5} {dest.stat().st_size}\n")
    if "--gzip" in flags and not Path(f"{dest}.gz").exists():
        with dest.open("rb") as a, gzip.open(f"{dest}.gz", "wb") as b:
            shutil.copyfileobj(a, b)
