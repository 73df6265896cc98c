"""The files boinc-dl puts into a BOINC project: templates, job.xml, launcher, plan class.

Every element was checked against what BOINC's source reads:

* input template (``tools/process_input_template.cpp``): one ``<file_info>`` per
  input passed to create_work, in the order of the command line; ``<number>`` is
  ignored, other elements (``<sticky/>``, ``<sticky_lifetime>``, ``<no_delete/>``) are
  copied to the workunit; ``<file_ref>`` i refers to the i-th ``<file_info>`` (``<file_number>`` is
  ignored) and needs ``<open_name>`` or ``<copy_file/>``. The template carries no
  ``<delay_bound>``/quorum/limit elements on purpose: they would override the values
  given on create_work's command line.
* output template (``tools/process_result_template.cpp``): ``<OUTFILE_i/>`` becomes
  ``<result>_r<random>_i``; every ``<file_info>`` must hold ``<max_nbytes>`` (upload
  certificates are signed over name + max_nbytes, or result creation fails).
* job.xml (``samples/wrapper/wrapper.cpp``): ``<application>`` is resolved as a
  logical name of the app version; ``<checkpoint_filename>`` (its mtime marks a
  checkpoint) and ``<fraction_done_filename>`` (last number in the file).
"""

from __future__ import annotations

import string
import xml.etree.ElementTree as ET
from importlib import resources
from pathlib import Path

from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.boinc.project import APP_NAME
from boinc_dl.server.backends.boinc.xmlmerge import to_xml
from boinc_dl.server.common.spec import JobSpec
from boinc_dl.server.common.weights import upload_bound

#: Order of create_work's input files = order of <file_info>s in the input template.
INPUT_ORDER = ("model.keras", "val.npz", "data.npz", "weights_in.h5", "wu.json")
#: Inputs shared by many units and cached on hosts.
STICKY_INPUTS = ("model.keras", "val.npz", "data.npz")
#: Inputs that outlive one workunit on the server (never removed by the file deleter).
NO_DELETE_INPUTS = ("model.keras", "val.npz", "data.npz", "weights_in.h5")
OUTPUT_ORDER = ("weights_out.h5", "metrics.json")
METRICS_MAX_NBYTES = 16 * 1024 * 1024

INPUT_TEMPLATE = f"templates/{APP_NAME}_in"
DEFAULT_OUTPUT_TEMPLATE = f"templates/{APP_NAME}_out"
#: The bound of the generic result template (workunits made by hand); boinc-dl's jobs use
#: a template sized to their model (``units.max_upload_bytes`` or the bound derived from it).
GENERIC_MAX_NBYTES = 512 * 1024 * 1024

LAUNCHER_LOGICAL = "bdl_launcher"
JOB_XML_LOGICAL = "job.xml"
GPU_PLAN_CLASS = "bdl_nvidia"
CPU_PLATFORM = "x86_64-pc-linux-gnu"


def _read(pkg_dir: str, name: str) -> str:
    return resources.files("boinc_dl.server.backends.boinc").joinpath(pkg_dir, name).read_text()


def input_template() -> str:
    """The workunit input template (installed as ``templates/boincdl_in``)."""
    return _read("templates", f"{APP_NAME}_in")


def output_template(max_nbytes: int, gzip: bool = False, report_immediately: bool = False) -> str:
    """The result template with the weights file bounded by ``max_nbytes``.

    ``report_immediately`` puts ``<report_immediately/>`` into ``<result>``: the
    scheduler copies the template's ``<result>`` to the client (``sched/sched_send.cpp``
    inserts only name, wu_name and deadline), the client parses the flag per result
    (``client/result.cpp``) and reports that result at once instead of lazily
    (``client/cs_scheduler.cpp``, ``find_project_with_overdue_results``).
    """
    tpl = string.Template(_read("templates", f"{APP_NAME}_out.in"))
    return tpl.substitute(
        weights_max_nbytes=str(int(max_nbytes)),
        metrics_max_nbytes=str(min(int(max_nbytes), METRICS_MAX_NBYTES)),
        gzip_when_done="\n        <gzip_when_done/>" if gzip else "",
        report_immediately="\n        <report_immediately/>" if report_immediately else "",
    )


def output_template_name(max_nbytes: int, gzip: bool = False, report_immediately: bool = False) -> str:
    """Project-relative path of the output template for a bound (one file per bound).

    Template files are referenced by path from every workunit record and read again
    whenever a result is (re)created, so they are never rewritten with other content:
    a different bound or flag gets a different file.
    """
    return (f"templates/{APP_NAME}_out_{int(max_nbytes)}{'_gz' if gzip else ''}"
            f"{'_ri' if report_immediately else ''}")


def job_xml() -> str:
    """The wrapper's job description (same for the CPU and GPU versions)."""
    return _read("files", "job.xml")


def launcher() -> str:
    """The launcher shell script the wrapper runs."""
    return _read("files", "launcher.sh")


def version_xml(wrapper: str, launcher_phys: str, job_phys: str) -> str:
    """``version.xml`` of an app version (parsed by ``tools/update_versions``)."""
    root = ET.Element("version")
    for phys, logical, main in ((wrapper, None, True), (launcher_phys, LAUNCHER_LOGICAL, False),
                                (job_phys, JOB_XML_LOGICAL, False)):
        f = ET.SubElement(root, "file")
        ET.SubElement(f, "physical_name").text = phys
        if main:
            ET.SubElement(f, "main_program")
        else:
            # resolved through a link file in the slot (boinc_resolve_filename), so the
            # launcher runs from the project dir where the client made it executable
            ET.SubElement(f, "logical_name").text = logical
    ET.SubElement(root, "is_wrapper")
    ET.indent(root, "    ")
    return to_xml(root) + "\n"


def gpu_plan_class(
    name: str = GPU_PLAN_CLASS,
    min_compcap: int = 500,
    min_driver_version: int = 52560,
    gpu_ram_mb: int = 2048,
    cpu_frac: float = 0.5,
) -> ET.Element:
    """A ``<plan_class>`` admitting current NVIDIA GPUs (``sched/plan_class_spec.cpp``).

    BOINC's built-in ``cuda`` class admits compute capability 1.x only
    (``sched/sched_customize.cpp``); this one takes compute capability >= 5.0
    (TensorFlow's floor) and a driver >= 525.60 (CUDA 12), with no upper bound.
    """
    pc = ET.Element("plan_class")
    for tag, val in (
        ("name", name),
        ("gpu_type", "nvidia"),
        ("cuda", None),
        ("min_nvidia_compcap", str(min_compcap)),
        ("min_driver_version", str(min_driver_version)),
        ("min_gpu_ram_mb", str(gpu_ram_mb)),
        ("gpu_ram_used_mb", str(gpu_ram_mb)),
        ("ngpus", "1"),
        ("cpu_frac", str(cpu_frac)),
    ):
        el = ET.SubElement(pc, tag)
        if val is not None:
            el.text = val
    return pc


#: The shims whose exit status is a verdict on a result (``script_validator``'s init and
#: compare scripts): a run that ended without one must say "not judged" (3), never "invalid".
VERDICT_SUBCOMMANDS = ("validate-init", "validate-compare")


def shim(command: list[str], project: Path, subcommand: str, pass_args: bool = True) -> str:
    """A POSIX-sh shim in the project's ``bin/`` that runs a boinc-dl command.

    BOINC's daemons run ``../bin/<script> tokens`` through ``system()`` from
    ``tmp_<host>``; the shim pins the project directory and hands every argument
    through untouched (``--`` keeps ``--error`` from being read as an option).

    The assimilator's and work generator's shims ``exec`` the command: any non-zero exit
    already means "not done, hand it over again". The validator's shims
    (:data:`VERDICT_SUBCOMMANDS`) run it as a child instead and answer 3
    (``VAL_RESULT_TRANSIENT_ERROR``) when it gave no verdict: killed by a signal (the
    OOM killer, an admin's ``kill -9``: status 128 + n through the shell), or not
    runnable at all (126, 127: a moved virtualenv). ``script_validator`` takes any
    other non-zero status of the init script for "invalid" (``init_result``,
    ``sched/script_validator.cpp``; a death by a signal reaches it as 137 through
    ``system()``'s shell), which marks a good result invalid, counts against its
    host, and asks for another replica that a small fleet under
    ``one_result_per_host_per_wu`` may never be able to send; and a compare script's
    for "the two results differ". Seen on a real server: one ``kill -9`` of the init
    script's Python marked a good result invalid and left its workunit unsendable.
    """
    parts = " ".join(_sh_quote(c) for c in command)
    tail = ' -- "$@"' if pass_args else ""
    run = f"{parts} {subcommand} --project {_sh_quote(str(project))}{tail}"
    head = (
        "#!/bin/sh\n"
        f"# boinc-dl: {subcommand} (installed by 'boinc-dl boinc install'; do not edit)\n"
        f"BDL_PROJECT={_sh_quote(str(project))}\n"
        "export BDL_PROJECT\n"
    )
    if subcommand not in VERDICT_SUBCOMMANDS:
        return head + f"exec {run}\n"
    return head + (
        f"{run}\n"
        "rc=$?\n"
        "# no verdict (killed by a signal, or not runnable): not judged (3), never \"invalid\"\n"
        "if [ \"$rc\" -gt 128 ] || [ \"$rc\" -eq 126 ] || [ \"$rc\" -eq 127 ]; then\n"
        "    echo \"bdl: $0 ended without a verdict (status $rc); BOINC judges the result again later\" >&2\n"
        "    exit 3\n"
        "fi\n"
        "exit \"$rc\"\n"
    )


def _sh_quote(s: str) -> str:
    if s and all(c.isalnum() or c in "@%+=:,./-_" for c in s):
        return s
    return "'" + s.replace("'", "'\"'\"'") + "'"


def job_upload_bound(store: JobStore, spec: JobSpec) -> int:
    """The bytes one result file of ``store``'s job may hold: the spec's
    ``units.max_upload_bytes``, else derived from its largest model (:func:`upload_bound`)."""
    if spec.units.max_upload_bytes is not None:
        return spec.units.max_upload_bytes
    return upload_bound([store.fingerprint(m) for m in store.models()])
