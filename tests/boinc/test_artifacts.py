"""Templates, job.xml, version.xml and the plan class, element by element against
what BOINC's readers accept (process_input_template.cpp, process_result_template.cpp,
samples/wrapper/wrapper.cpp, tools/update_versions, sched/plan_class_spec.cpp)."""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET

from boinc_dl.server.backends.boinc import artifacts
from boinc_dl.server.common.workunit import INPUT_NAMES, OUTPUT_NAMES

# elements process_file_info() reads; anything else is copied into the workunit
FILE_INFO_READ = {"gzip", "physical_name", "url", "number", "md5_cksum", "nbytes", "gzipped_nbytes"}
# FILE_INFO::parse (client: sticky, sticky_lifetime since 7.9) and the file deleter (no_delete)
FILE_INFO_COPIED_OK = {"sticky", "sticky_lifetime", "no_delete"}
# elements process_workunit() reads into the workunit record (they override the command line)
WORKUNIT_PARAMS = {"rsc_fpops_est", "rsc_fpops_bound", "rsc_memory_bound", "rsc_bandwidth_bound",
                   "rsc_disk_bound", "batch", "delay_bound", "min_quorum", "target_nresults",
                   "max_error_results", "max_total_results", "max_success_results", "size_class"}
FILE_REF_READ = {"open_name", "file_number", "copy_file"}
# TASK::parse in wrapper.cpp
WRAPPER_TASK = {"application", "exec_dir", "setenv", "stdin_filename", "stdout_filename",
                "stderr_filename", "command_line", "checkpoint_filename", "fraction_done_filename",
                "weight", "daemon", "forward_slashes", "multi_process", "append_cmdline_args",
                "time_limit", "priority"}
# PLAN_CLASS_SPEC::parse in plan_class_spec.cpp (the GPU-related subset we may use)
PLAN_CLASS_READ = {"name", "gpu_type", "cuda", "min_nvidia_compcap", "max_nvidia_compcap",
                   "min_driver_version", "max_driver_version", "min_gpu_ram_mb", "gpu_ram_used_mb",
                   "ngpus", "cpu_frac", "min_cuda_version", "max_cuda_version", "avg_ncpus",
                   "projected_flops_scale", "gpu_peak_flops_scale"}


def test_input_template_file_infos() -> None:
    text = artifacts.input_template()
    root = ET.fromstring(text)
    assert root.tag == "input_template"
    infos = root.findall("file_info")
    assert len(infos) == len(artifacts.INPUT_ORDER) == 5
    for i, fi in enumerate(infos):
        tags = {c.tag for c in fi}
        assert tags <= FILE_INFO_READ | FILE_INFO_COPIED_OK, tags
        assert fi.find("physical_name") is None, "a constant file would not consume a create_work argument"
        assert fi.findtext("number").strip() == str(i)
        logical = artifacts.INPUT_ORDER[i]
        assert (fi.find("sticky") is not None) == (logical in artifacts.STICKY_INPUTS)
        assert (fi.find("no_delete") is not None) == (logical in artifacts.NO_DELETE_INPUTS)
        # hosts drop a cached subset 14 days after the last unit that used it
        assert (fi.findtext("sticky_lifetime") == "1209600") == (logical in artifacts.STICKY_INPUTS)
        # boolean elements as BOINC writes them: empty tags
        for c in fi:
            if c.tag in ("sticky", "no_delete"):
                assert c.text is None and len(c) == 0


def test_input_template_file_refs_in_order() -> None:
    text = artifacts.input_template()
    work = ET.fromstring(text).find("workunit")
    refs = work.findall("file_ref")
    # process_workunit(): the i-th <file_ref> is the i-th file; <file_number> is ignored
    assert [r.findtext("open_name").strip() for r in refs] == list(artifacts.INPUT_ORDER)
    assert [int(r.findtext("file_number")) for r in refs] == list(range(5))
    for r in refs:
        assert {c.tag for c in r} <= FILE_REF_READ
        assert r.find("copy_file") is not None
        assert r.find("file_name") is None  # "ignored in <file_ref>" with a complaint
    # match_tag("copy_file/"): only the self-closing spelling is recognised
    assert text.count("<copy_file/>") == 5
    # nothing that would silently override create_work's --delay_bound, quorum and limits
    assert not WORKUNIT_PARAMS & {c.tag for c in work}
    assert work.find("command_line") is None
    assert set(artifacts.INPUT_ORDER) == set(INPUT_NAMES)


def test_output_template() -> None:
    text = artifacts.output_template(123456789)
    root = ET.fromstring(text)
    assert root.tag == "output_template"
    infos = root.findall("file_info")
    assert len(infos) == 2
    # add_signatures() looks for "<file_info>\n" and needs <name> and <max_nbytes> in each
    assert text.count("<file_info>\n") == 2
    for i, fi in enumerate(infos):
        name = fi.find("name")
        assert [c.tag for c in name] == [f"OUTFILE_{i}"]
        assert fi.find("generated_locally") is not None
        assert fi.find("upload_when_present") is not None
        assert [c.tag for c in fi.find("url")] == ["UPLOAD_URL"]
        assert fi.find("gzip_when_done") is None
    assert int(infos[0].findtext("max_nbytes")) == 123456789
    assert int(infos[1].findtext("max_nbytes")) == min(123456789, artifacts.METRICS_MAX_NBYTES)
    refs = root.find("result").findall("file_ref")
    assert [r.findtext("open_name") for r in refs] == list(artifacts.OUTPUT_ORDER) == list(OUTPUT_NAMES)
    for i, r in enumerate(refs):
        assert [c.tag for c in r.find("file_name")] == [f"OUTFILE_{i}"]
        assert r.find("copy_file") is not None
    # the transitioner's macro substitution: <OUTFILE_i/> -> <result>_r<rand>_i
    base = "job__m0_e0001_s0003_0_r42_"
    out = re.sub(r"<OUTFILE_(\d+)/>", lambda m: base + m.group(1), text)
    assert "job__m0_e0001_s0003_0_r42_0" in out and "job__m0_e0001_s0003_0_r42_1" in out
    for m in re.finditer(r"<OUTFILE_", text):  # format check of process_result_template()
        rest = text[m.end():]
        assert rest.index("/>") + 1 == rest.index(">")


def test_output_template_gzip_and_name() -> None:
    text = artifacts.output_template(1000, gzip=True)
    root = ET.fromstring(text)
    assert all(fi.find("gzip_when_done") is not None for fi in root.findall("file_info"))
    assert artifacts.output_template_name(1000) == "templates/boincdl_out_1000"
    assert artifacts.output_template_name(1000, True) == "templates/boincdl_out_1000_gz"


def test_job_xml() -> None:
    root = ET.fromstring(artifacts.job_xml())
    assert root.tag == "job_desc"
    tasks = root.findall("task")
    assert len(tasks) == 1
    t = tasks[0]
    assert {c.tag for c in t} <= WRAPPER_TASK
    assert t.findtext("application") == artifacts.LAUNCHER_LOGICAL
    assert t.findtext("checkpoint_filename") == "checkpoint.json"
    assert t.findtext("fraction_done_filename") == "fraction_done"


def test_version_xml() -> None:
    root = ET.fromstring(artifacts.version_xml("wrapper_26016_x86_64-pc-linux-gnu", "bdl_launcher_1.0.sh",
                                               "bdl_job_1.0.xml"))
    assert root.tag == "version"
    files = root.findall("file")
    mains = [f for f in files if f.find("main_program") is not None]
    assert [f.findtext("physical_name") for f in mains] == ["wrapper_26016_x86_64-pc-linux-gnu"]
    logical = {f.findtext("logical_name"): f.findtext("physical_name") for f in files if f.find("logical_name") is not None}
    assert logical == {"bdl_launcher": "bdl_launcher_1.0.sh", "job.xml": "bdl_job_1.0.xml"}
    assert root.find("is_wrapper") is not None
    for f in files:  # convert_simplexml() reads these
        assert {c.tag for c in f} <= {"physical_name", "logical_name", "main_program", "copy_file", "url", "gzip"}


def test_gpu_plan_class_admits_current_gpus() -> None:
    pc = artifacts.gpu_plan_class()
    assert {c.tag for c in pc} <= PLAN_CLASS_READ
    assert pc.findtext("gpu_type") == "nvidia"
    assert pc.find("cuda") is not None
    # the built-in 'cuda' class needs compute capability in [1.0, 2.0); ours any >= 5.0
    assert int(pc.findtext("min_nvidia_compcap")) == 500
    assert pc.find("max_nvidia_compcap") is None
    for cc in (500, 750, 860, 890, 900, 1200):  # Maxwell .. Blackwell: CC*100 as BOINC encodes it
        assert cc >= int(pc.findtext("min_nvidia_compcap"))
    assert float(pc.findtext("ngpus")) == 1.0


def test_launcher_is_posix_sh() -> None:
    import shutil
    import subprocess

    text = artifacts.launcher()
    assert text.startswith("#!/bin/sh\n")
    assert "-m boinc_dl.client_app --slot" in text
    sh = shutil.which("sh")
    assert subprocess.run([sh, "-n", "-c", text]).returncode == 0
    dash = shutil.which("dash")
    if dash:
        assert subprocess.run([dash, "-n", "-c", text]).returncode == 0


def test_shim() -> None:
    from pathlib import Path

    s = artifacts.shim(["/usr/bin/python3", "-m", "boinc_dl.server.backends.boinc"], Path("/home/boincadm/my project"), "assimilate")
    assert s.startswith("#!/bin/sh\n")
    assert "exec /usr/bin/python3 -m boinc_dl.server.backends.boinc assimilate --project '/home/boincadm/my project' -- \"$@\"" in s


def test_launcher_execs_python_with_the_wrappers_pid(tmp_path) -> None:
    """The launcher replaces itself by Python (BOINC's wrapper signals only its direct
    child) and tells it the wrapper's pid; Python's exit status is the task's. The
    resume after a spot notice lives in Python (tests/boinc/test_launcher_signals.py)."""
    import subprocess

    launcher = tmp_path / "bdl_launcher_1.0.sh"
    launcher.write_text(artifacts.launcher())
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho \"$$ $PPID $BDL_PARENT_PID $*\" > {tmp_path}/seen\nexit 75\n")
    fake.chmod(0o755)
    slot = tmp_path / "slot"
    slot.mkdir()
    env = {"PATH": "/usr/bin:/bin", "BDL_PYTHON": str(fake)}
    p = subprocess.Popen(["/bin/sh", str(launcher), "--threads", "2"], cwd=slot, env=env)
    assert p.wait(60) == 75  # passed through, no resume loop in the shell
    pid, ppid, parent, *args = (tmp_path / "seen").read_text().split()
    assert int(pid) == p.pid  # exec: the wrapper's child is Python itself
    assert int(ppid) == int(parent) == os.getpid()
    assert args == ["-m", "boinc_dl.client_app", "--slot", str(slot), "--threads", "2"]
