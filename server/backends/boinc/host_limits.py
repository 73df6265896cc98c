"""One host must not take the window: a per-host cap on boinc-dl's tasks in progress.

BOINC's scheduler fills a host's work request from the job cache until the request's
seconds are covered (``sched/sched_send.cpp``). boinc-dl keeps few units in flight (MOP:
one per model; VC-ASGD: the window of :mod:`.hosts`), so one host that asks for a day's
buffer of short tasks can take all of them while the next host gets "no tasks" and backs
off (measured: one 2-slot client held 4-5 tasks, 2 running, while the other had none;
once 6 tasks in one reply).

The cap is ``config_aux.xml``'s per-app limit (``<max_jobs_in_progress>``, parsed by
``SCHED_CONFIG::parse_aux``, ``sched/sched_config.cpp``; ``JOB_LIMITS`` in
``sched/sched_limit.h``)::

    <config><max_jobs_in_progress><app>
        <app_name>boincdl</app_name>
        <cpu_limit><jobs>1</jobs><per_proc/></cpu_limit>
        <gpu_limit><jobs>1</jobs><per_proc/></gpu_limit>
    </app></max_jobs_in_progress></config>

``per_proc`` scales the limit by the host's usable CPUs (``effective_ncpus``: ``p_ncpus``
reduced by the host's CPU-percentage preference and ``max_ncpus``) or GPUs, at the start
of each request (``WORK_REQ::get_job_limits``). The jobs counted are the app's tasks the
client lists as in progress (``other_results``) plus those sent in this reply
(``config.max_jobs_in_progress.register_job``); a task reported in the same request no
longer counts. So a host holds at most one boinc-dl task per slot, gets its next one in
the request that reports a finished one, and the units it cannot take stay for the
other hosts. Unlike config.xml's ``<max_wus_in_progress>`` this limits only app
``boincdl``.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from boinc_dl.server.backends.boinc.project import APP_NAME, BoincProjectError
from boinc_dl.server.backends.boinc.xmlmerge import (
    XmlDoc,
    append_child,
    child_text,
    remove_child,
    replace_child,
    same_element,
)

CONFIG_AUX = "config_aux.xml"
#: Default cap: tasks in progress per usable CPU (and per GPU).
DEFAULT_JOBS_PER_SLOT = 1


def app_limit(jobs_per_slot: int, app: str = APP_NAME) -> ET.Element:
    """The ``<app>`` entry of ``<max_jobs_in_progress>``: ``jobs_per_slot`` per CPU and per GPU."""
    el = ET.Element("app")
    ET.SubElement(el, "app_name").text = app
    for kind in ("cpu_limit", "gpu_limit"):
        lim = ET.SubElement(el, kind)
        ET.SubElement(lim, "jobs").text = str(int(jobs_per_slot))
        ET.SubElement(lim, "per_proc")
    return el


def set_jobs_per_slot(project_root: Path, jobs_per_slot: int, app: str = APP_NAME) -> list[str]:
    """Cap ``app``'s tasks in progress per host at ``jobs_per_slot`` per CPU/GPU in
    ``config_aux.xml`` (created if missing; 0 removes the cap); what changed. Every other
    entry of the file is kept."""
    if isinstance(jobs_per_slot, bool) or not isinstance(jobs_per_slot, int) or jobs_per_slot < 0:
        raise BoincProjectError(f"--jobs-per-slot must be a whole number >= 0, got {jobs_per_slot!r}")
    path = Path(project_root) / CONFIG_AUX
    if jobs_per_slot == 0 and not path.exists():
        return []
    doc = XmlDoc.load(path, "config", create=True)
    created = list(doc.changes)
    doc.changes.clear()
    limits = doc.root.find("max_jobs_in_progress")
    if limits is None:
        if jobs_per_slot == 0:
            return []
        limits = ET.Element("max_jobs_in_progress")
        append_child(doc.root, limits, 0)
    ours = [a for a in limits.findall("app") if child_text(a, "app_name") == app]
    want = app_limit(jobs_per_slot, app)
    what = f"{jobs_per_slot} {app} task(s) in progress per CPU and per GPU of a host"
    if jobs_per_slot == 0:
        for a in ours:
            remove_child(limits, a)
            doc.changes.append(f"removed the per-host cap on {app} tasks")
    elif not ours:
        append_child(limits, want, 1)
        doc.changes.append(f"set <max_jobs_in_progress> for app {app}: {what}")
    elif not same_element(ours[0], want):
        replace_child(limits, ours[0], want, 1)
        doc.changes.append(f"changed <max_jobs_in_progress> for app {app}: {what}")
    if doc.changes:
        doc.changes[:0] = created
    doc.save()
    return list(doc.changes)


def jobs_per_slot(project_root: Path, app: str = APP_NAME) -> int | None:
    """The cap install set (tasks per CPU) for ``app``; None when there is none."""
    path = Path(project_root) / CONFIG_AUX
    if not path.is_file():
        return None
    try:
        root = ET.parse(path).getroot()  # nosec B314 - the project's own file
    except ET.ParseError:
        return None
    for a in root.findall("max_jobs_in_progress/app"):
        cpu = a.find("cpu_limit")
        if child_text(a, "app_name") == app and cpu is not None:
            try:
                return int(child_text(cpu, "jobs") or 0) or None
            except ValueError:
                return None
    return None


__all__ = ["CONFIG_AUX", "DEFAULT_JOBS_PER_SLOT", "app_limit", "jobs_per_slot", "set_jobs_per_slot"]
