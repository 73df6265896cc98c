"""Fake ``bin/create_work``: accepts exactly the options of BOINC's tools/create_work.cpp.

Main options (with their number of values) and the per-line options of ``--stdin``
follow the real parser; anything else starting with '-' fails like the real tool
("bad argument"). The checks of create_work2() are applied, template values override
command-line values as process_input_template() does, and created workunits go into
the fake database (a duplicate name fails the batch like the SQL insert).
"""

import re
import shlex
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import _fakemysql
from _fakelib import PROJECT, config_value, database, die, hier_path, is_project_dir, record

MAIN = {
    "appname": 1, "d": 1, "wu_name": 1, "wu_template": 1, "result_template": 1, "config_dir": 1,
    "batch": 1, "priority": 1, "credit": 1, "rsc_fpops_est": 1, "rsc_fpops_bound": 1,
    "rsc_memory_bound": 1, "size_class": 1, "app_version_num": 1, "rsc_disk_bound": 1,
    "delay_bound": 1, "hr_class": 1, "min_quorum": 1, "target_nresults": 1, "max_error_results": 1,
    "max_total_results": 1, "max_success_results": 1, "command_line": 1, "wu_id": 1, "broadcast": 0,
    "broadcast_user": 1, "broadcast_team": 1, "target_host": 1, "target_user": 1, "target_team": 1,
    "help": 0, "stdin": 0, "remote_file": 3, "verbose": 0, "continue_on_error": 0, "keywords": 1,
    "sub_appname": 1,
}
STDIN = {"command_line": 1, "wu_name": 1, "wu_template": 1, "result_template": 1, "remote_file": 3,
         "target_host": 1, "target_user": 1, "priority": 1}
DEFAULTS = {"min_quorum": 1, "target_nresults": 1, "max_error_results": 1, "max_total_results": 1,
            "max_success_results": 1, "delay_bound": 7 * 86400, "rsc_fpops_est": 3600e9,
            "rsc_fpops_bound": 86400e9, "rsc_memory_bound": 5e8, "rsc_disk_bound": 1e9}
INT_FIELDS = ("min_quorum", "target_nresults", "max_error_results", "max_total_results",
              "max_success_results", "delay_bound")
TEMPLATE_FIELDS = ("rsc_fpops_est", "rsc_fpops_bound", "rsc_memory_bound", "rsc_bandwidth_bound",
                   "rsc_disk_bound", "batch", "delay_bound", "min_quorum", "target_nresults",
                   "max_error_results", "max_total_results", "max_success_results", "size_class")


def parse(args, table, where):
    opts, files = {}, []
    i = 0
    while i < len(args):
        a = args[i]
        name = re.sub(r"^--?", "", a) if a.startswith("-") else None
        if name is not None and name in table:
            n = table[name]
            if i + n >= len(args) + (0 if n else 1):
                die(f"create_work: missing value for {a}")
            opts[name] = args[i + 1 : i + 1 + n] if n > 1 else (args[i + 1] if n else True)
            i += 1 + n
        elif name is not None:
            die(f"create_work: bad {where}argument '{a}'")
        else:
            files.append(a)
            i += 1
    return opts, files


def process_input_template(text, infiles, wu):
    root = ET.fromstring(text)
    infos = root.findall("file_info")
    var = [fi for fi in infos if fi.find("physical_name") is None]
    if len(var) != len(infiles):
        die(f"process_input_template: {len(infiles)} input files given, but template has {len(var)}")
    work = root.find("workunit")
    if work is None:
        die("process_input_template: bad WU template - no <workunit>")
    refs = work.findall("file_ref")
    if len(refs) != len(infos):
        die("#file refs != #file infos")
    for ref in refs:
        if ref.find("open_name") is None and ref.find("copy_file") is None:
            die("No open name found and copy_file not specified")
    for tag in TEMPLATE_FIELDS:  # the template overrides the command line
        el = work.find(tag)
        if el is not None:
            wu[tag] = float(el.text)
    download = config_value("download_dir")
    fanout = int(config_value("uldl_dir_fanout") or 1024)
    for name in infiles:
        p = hier_path(name, download, fanout)
        if not p.exists() and not (Path(download) / name).exists():
            die(f"process_input_template: md5_file {name}: file not found")


def atoi(text: str) -> int:
    """C's ``atoi``: the leading integer of ``text`` (0 when there is none)."""
    m = re.match(r"\s*([+-]?\d+)", text)
    return int(m.group(1)) if m else 0


def main():
    args = sys.argv[1:]
    stdin = sys.stdin.read() if "--stdin" in args or "-stdin" in args else None
    record("create_work", stdin)
    opts, files = parse(args, MAIN, "")
    if "appname" not in opts:
        die("usage: create_work [options] infile1 infile2 ...")
    if not is_project_dir("."):
        die("Not in a project directory or subdirectory")
    with database() as db:
        if opts["appname"] not in db["apps"]:
            die("create_work: app not found")
    base = {k: float(opts.get(k, v)) for k, v in DEFAULTS.items()}
    for k in INT_FIELDS:
        base[k] = int(float(opts[k])) if k in opts else int(base[k])
    main_tpl = opts.get("wu_template", f"templates/{opts['appname']}_in")
    main_res = opts.get("result_template", f"templates/{opts['appname']}_out")
    if not Path(main_tpl).exists() and stdin is None:
        die(f"create_work: input template file {main_tpl} doesn't exist")
    jobs = []
    if stdin is None:
        jobs.append((opts.get("wu_name", "job"), main_tpl, main_res, files, None))
    else:
        for j, line in enumerate(stdin.splitlines()):
            if len(line) + 1 >= 4096:
                die("fgets() buffer was too small")
            lo, lf = parse(shlex.split(line), STDIN, "stdin ")
            jobs.append((lo.get("wu_name", f"{opts.get('wu_name', 'job')}_{j}"),
                         lo.get("wu_template", main_tpl), lo.get("result_template", main_res), lf,
                         atoi(lo["priority"]) if "priority" in lo else None))
    created = []
    for name, tpl, res, infiles, line_priority in jobs:
        if not Path(tpl).exists():
            die(f"Can't read WU template {tpl}")
        wu = dict(base)
        # --priority: the call's, a line's own over it (atoi, as create_work reads it)
        wu["priority"] = line_priority if line_priority is not None else atoi(opts.get("priority", "0"))
        process_input_template(Path(tpl).read_text(), infiles, wu)
        if not Path(res).exists():
            die(f"create_work: result template file {res} doesn't exist")
        if wu["max_success_results"] > wu["max_total_results"]:
            die("max_success_results > max_total_results; can't create job")
        if wu["max_error_results"] > wu["max_total_results"]:
            die("max_error_results > max_total_results; can't create job")
        if wu["target_nresults"] > wu["max_success_results"]:
            die("target_nresults > max_success_results; can't create job")
        created.append({"name": name, "wu_template": tpl, "result_template": res, "infiles": infiles,
                        "appname": opts["appname"], **wu})
    with database() as db:
        for wu in created:
            if wu["name"] in db["workunits"]:
                die(f"wu.insert_batch() failed: -1\nMySQL error: Duplicate entry '{wu['name']}' for key 'name'")
        for wu in created:
            wu["id"] = db["next_wu_id"]
            db["next_wu_id"] += 1
            wu["error_mask"] = 0
            db["workunits"][wu["name"]] = wu
    if _fakemysql.enabled(PROJECT):
        insert_sql(created)


def insert_sql(created):
    """The batch into the SQL database, as one transaction; then target_nresults UNSENT
    results per workunit, as the transitioner's first pass creates them."""
    now = int(time.time())
    conn = _fakemysql.connect(PROJECT)
    with conn.cursor() as c:
        for wu in created:
            c.execute("INSERT INTO workunit (create_time, name, rsc_fpops_est, rsc_fpops_bound, delay_bound, "
                      "min_quorum, target_nresults, max_error_results, max_total_results, max_success_results, "
                      "priority) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)",
                      (now, wu["name"], wu["rsc_fpops_est"], wu["rsc_fpops_bound"], int(wu["delay_bound"]),
                       int(wu["min_quorum"]), int(wu["target_nresults"]), int(wu["max_error_results"]),
                       int(wu["max_total_results"]), int(wu["max_success_results"]), wu["priority"]))
            wu_id = c.lastrowid
            for i in range(int(wu["target_nresults"])):  # result.priority = wu.priority (backend_lib.cpp)
                c.execute("INSERT INTO result (create_time, workunitid, server_state, name, priority) "
                          "VALUES (%s,%s,2,%s,%s)", (now, wu_id, f"{wu['name']}_{i}", wu["priority"]))
    conn.close()


main()
