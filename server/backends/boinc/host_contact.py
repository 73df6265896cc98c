"""Keep BOINC hosts asking for work: the project's ``<next_rpc_delay>``.

A BOINC client that asks a project for work and gets none backs off that project's work
fetch for ``(0.5 + U[0,1)) x 600 s``, doubling up to a day (``resource_backoff`` in
``client/work_fetch.cpp``, ``WF_MIN_BACKOFF_INTERVAL`` / ``WF_MAX_BACKOFF_INTERVAL`` in
``client/client_state.h``). boinc-dl's work appears a few units at a time (MOP's next unit
of a model exists only once the previous one is merged; VC-ASGD keeps a bounded window), so
a host that asks a few seconds too early sits out 5 to 15 minutes, then 10 to 30.

The scheduler's ``<next_rpc_delay>`` (config.xml, ``sched/sched_config.cpp``) is sent in
every reply (``sched/sched_types.cpp``). The client then contacts the project again that
many seconds after its last RPC, whatever else it is doing (``handle_scheduler_reply`` sets
``next_rpc_time``; ``next_project_sched_rpc_pending`` raises an RPC of reason
``RPC_REASON_PROJECT_REQ``, ``client/cs_scheduler.cpp``). That RPC:

* carries a work request *despite* an active work-fetch backoff:
  ``piggyback_work_request`` accepts ``RSC_REASON_BACKED_OFF`` (``client/work_fetch.cpp``),
  and asks for work whenever the host's buffer is below its preferences (an idle slot);
* does not lengthen the backoff when it gets nothing: ``WORK_FETCH::handle_reply`` backs
  off only after RPCs of reason ``RESULTS_DUE``, ``NEED_WORK`` or ``TRICKLE_UP``;
* clears the backoff when it gets work (``clear_backoff``), so normal fetching resumes;
* also reports finished tasks, so a result held back by a backed-off client reaches the
  validator and assimilator within ``next_rpc_delay``.

It only waits for the RPC backoff (``min_rpc_time``: the scheduler's ``request_delay``,
``min_sendwork_interval``), which a "no tasks" reply does not set
(``DELAY_NO_WORK_TEMP = 0``, ``sched/sched_main.h``).

Cost: at most ``3600 / next_rpc_delay`` scheduler requests per host per hour (every RPC
restarts the timer, so a host already talking to the project more often adds nothing);
each one a short scheduler CGI run with a few database reads of the host, its results and
the shared-memory job cache.

``<maintenance_delay>``: while the project is stopped (``bin/stop`` writes ``stop_sched``
and ``bin/start`` removes it only after its daemons are up), or while the feeder is not
running, every scheduler request is answered "project down" with a ``request_delay`` of
``maintenance_delay`` seconds, 3600 by default (``sched/sched_main.cpp``,
``sched/sched_config.cpp``). The client then defers *every* RPC to that project, the
``next_rpc_delay`` ones included (they honour ``min_rpc_time``), so a restart window of W
seconds sends about W / next_rpc_delay of all hosts away for an hour. boinc-dl sets it to
half a minute. The client itself backs off 60-120 s after such a reply (an RPC failure,
:data:`CLIENT_DOWN_BACKOFF_MAX_S`), so a host that hits a restart comes back one to two
minutes later, when the daemons are long up. A host with a finished task that a restart
catches reports it only after that deferral, so every workunit's deadline is the unit's
``timeout_s`` plus the longest deferral (:func:`host_wait_s`): a restart never makes a
host late.

``<min_sendwork_interval>``: every scheduler reply then carries a ``request_delay`` of at
least ``max(1.01 x msi, msi + 1)`` seconds (``SCHEDULER_REPLY::write``,
``sched/sched_types.cpp``): 7 s for the 6 s that ``make_project --production`` writes
(``py/Boinc/setup_project.py``). The client defers every RPC to the project until then
(``min_rpc_time``), ``report_immediately`` ones included: a task that finishes a few
seconds after the previous RPC (the one that reported the task before it, or fetched
work) waits out the rest of the delay before it is reported, then up to one more
5 s scheduler poll (``SCHEDULER_RPC_POLL_PERIOD``, ``client/cs_scheduler.cpp``). For
VC-ASGD that wait is staleness, so boinc-dl sets it to 0: the scheduler adds no delay
and refuses no work request for coming too soon. Cost: a host may then contact the
scheduler at most once per 5 s poll when it has a reason to (a finished task, an idle
slot), at most 720 requests per host per hour; in practice about one per finished task,
since reports and work requests travel together.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from boinc_dl.server.backends.boinc.project import BoincProjectError
from boinc_dl.server.backends.boinc.xmlmerge import XmlDoc, append_child, child_text, remove_child

#: Default ``<next_rpc_delay>`` set by ``boinc-dl boinc install`` (seconds).
DEFAULT_NEXT_RPC_DELAY_S = 60.0
TAG = "next_rpc_delay"
#: Default ``<maintenance_delay>`` set by ``boinc-dl boinc install`` (seconds; BOINC's is 3600).
#: ``boinc-dl boinc restart`` keeps the project down for 5-15 s; a host it catches comes
#: back half a minute later, and every deadline is extended by this much (:func:`host_wait_s`).
DEFAULT_MAINTENANCE_DELAY_S = 30.0
MAINTENANCE_TAG = "maintenance_delay"
#: BOINC's ``maintenance_delay`` when config.xml sets none (``sched/sched_config.cpp``).
BOINC_MAINTENANCE_DELAY_S = 3600.0
#: The client's own wait after a "project down" reply: the reply is an RPC failure
#: (``ERR_PROJECT_DOWN``, ``client/cs_scheduler.cpp``), and ``project_rpc_backoff``
#: (``client/scheduler_op.cpp``) defers the next RPC by ``SCHED_RETRY_DELAY_MIN`` (60 s)
#: x 2^failures x U[0.5, 1): 60-120 s after the first one, whatever ``request_delay``
#: says. Measured on a 7.20.5 client: a 30 s ``maintenance_delay`` deferred it 71 s.
CLIENT_DOWN_BACKOFF_MAX_S = 120.0
#: Default ``<min_sendwork_interval>`` set by ``boinc-dl boinc install`` (seconds).
DEFAULT_MIN_SENDWORK_INTERVAL_S = 0
MIN_SENDWORK_TAG = "min_sendwork_interval"


def request_delay_s(min_sendwork_interval_s: float) -> float:
    """The least ``request_delay`` every scheduler reply carries (``sched/sched_types.cpp``)."""
    msi = float(min_sendwork_interval_s)
    if msi <= 0:
        return 0.0
    return max(1.01 * msi, msi + 1)


def host_wait_s(config: dict[str, str | None] | object) -> float:
    """The longest wait boinc-dl's own settings can impose on a host that has a finished
    task to report: a "project down" reply during a restart defers the host by
    ``maintenance_delay`` (BOINC's 3600 s when unset) or by the client's own backoff after
    a failed RPC (at most :data:`CLIENT_DOWN_BACKOFF_MAX_S`), whichever is longer; plus
    the ``request_delay`` every reply carries (``min_sendwork_interval``). Every workunit's ``delay_bound`` is the
    unit's ``timeout_s`` plus this, so a host sent away by ``boinc-dl boinc restart``
    still reports before its deadline (a task finishing as the restart begins waits the
    whole deferral). ``config`` is anything with ``get(tag)`` (config.xml's ``<config>``)."""
    get = config.get  # type: ignore[attr-defined]

    def seconds(tag: str, default: float) -> float:
        raw = get(tag)
        try:
            return float(raw) if raw not in (None, "") else default
        except (TypeError, ValueError):
            return default

    maintenance = seconds(MAINTENANCE_TAG, BOINC_MAINTENANCE_DELAY_S)
    if maintenance <= 0:
        maintenance = BOINC_MAINTENANCE_DELAY_S
    return max(maintenance, CLIENT_DOWN_BACKOFF_MAX_S) + request_delay_s(seconds(MIN_SENDWORK_TAG, 0.0))


def requests_per_host_hour(next_rpc_delay_s: float) -> float:
    """Upper bound of the scheduler requests one idle-or-busy host adds per hour."""
    return 3600.0 / next_rpc_delay_s if next_rpc_delay_s > 0 else 0.0


def _fmt(seconds: float) -> str:
    return str(int(seconds)) if float(seconds).is_integer() else f"{seconds:g}"


def set_next_rpc_delay(config_xml: Path, seconds: float) -> list[str]:
    """Set ``<config><next_rpc_delay>`` in config.xml (0 removes it); what changed.

    Idempotent: the same value a second time changes nothing. Every other setting,
    comment and daemon is kept.
    """
    return set_config_seconds(config_xml, TAG, seconds, "--next-rpc-delay")


def set_maintenance_delay(config_xml: Path, seconds: float) -> list[str]:
    """Set ``<config><maintenance_delay>`` in config.xml (0 removes it: BOINC's 3600 s)."""
    return set_config_seconds(config_xml, MAINTENANCE_TAG, seconds, "--maintenance-delay")


def set_min_sendwork_interval(config_xml: Path, seconds: int) -> list[str]:
    """Set ``<config><min_sendwork_interval>`` (whole seconds, 0 written as 0: no delay)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int):
        raise BoincProjectError(f"--min-sendwork-interval must be whole seconds, got {seconds!r}")
    return set_config_seconds(config_xml, MIN_SENDWORK_TAG, seconds, "--min-sendwork-interval", keep_zero=True)


def set_config_seconds(config_xml: Path, tag: str, seconds: float, option: str,
                       keep_zero: bool = False) -> list[str]:
    """Set a seconds-valued ``<config><tag>`` in config.xml; what changed. 0 removes the
    element unless ``keep_zero`` (then 0 is written: BOINC reads it as "off" either way,
    but an admin reading config.xml sees the choice)."""
    if not (seconds >= 0 and seconds < 1e7):
        raise BoincProjectError(f"{option} must be >= 0 seconds, got {seconds}")
    doc = XmlDoc.load(config_xml, "boinc")
    cfg = doc.root.find("config")
    if cfg is None:
        raise BoincProjectError(f"{config_xml}: no <config> section (not a BOINC project config?)")
    cur = cfg.find(tag)
    if seconds == 0 and not keep_zero:
        if cur is not None:
            remove_child(cfg, cur)
            doc.changes.append(f"removed <{tag}>")
    else:
        want = _fmt(seconds)
        if cur is None:
            el = ET.Element(tag)
            el.text = want
            append_child(cfg, el, 1)
            doc.changes.append(f"set <{tag}> to {want} s")
        elif child_text(cfg, tag) != want:
            old = child_text(cfg, tag)
            cur.text = want
            doc.changes.append(f"changed <{tag}> from {old} to {want} s")
    doc.save()
    return list(doc.changes)


__all__ = [
    "DEFAULT_MAINTENANCE_DELAY_S",
    "DEFAULT_MIN_SENDWORK_INTERVAL_S",
    "DEFAULT_NEXT_RPC_DELAY_S",
    "host_wait_s",
    "request_delay_s",
    "requests_per_host_hour",
    "set_config_seconds",
    "set_maintenance_delay",
    "set_min_sendwork_interval",
    "set_next_rpc_delay",
]
