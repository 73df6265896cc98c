"""What ``min_quorum`` needs from BOINC's scheduler: replicas of a unit on different hosts.

With ``min_quorum`` 2 or more, each unit is computed several times and the compare
script accepts it only when two replicas agree. That defends against a hostile host only
if the replicas come from different hosts (better: different volunteers). BOINC's
scheduler sends a host a second replica of a workunit it already ran unless config.xml
says otherwise (``slow_check`` in ``sched/sched_check.cpp``; ``make_project`` writes
``<one_result_per_user_per_wu>0``):

* ``<one_result_per_user_per_wu>``: no two results of a workunit to one user (account),
  and so none to one host either. Against hostile volunteers, who control every host
  of their account. The scheduler checks it first and then ignores the host rule.
* ``<one_result_per_host_per_wu>``: no two results of a workunit to one host. For a
  fleet whose hosts all attach with one account (the cloud fleets of ``infra/``): the
  user rule would leave each unit's second replica unsendable there.

Both apply to every app of the project.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Literal

from boinc_dl.server.backends.boinc.project import BoincProjectError
from boinc_dl.server.backends.boinc.xmlmerge import XmlDoc, append_child

PER_USER = "one_result_per_user_per_wu"
PER_HOST = "one_result_per_host_per_wu"
Across = Literal["users", "hosts"]


def boinc_bool(el: ET.Element | None) -> bool:
    """A config.xml flag as BOINC's ``parse_bool`` reads it: ``<tag/>`` is true, ``<tag>N</tag>``
    is true when N is a non-zero number, a missing element is false."""
    if el is None:
        return False
    text = (el.text or "").strip()
    if not text:
        return True
    try:
        return int(text) != 0
    except ValueError:
        return False


def replica_rule(config_xml: Path) -> Across | None:
    """How BOINC's scheduler keeps a workunit's replicas apart in this project: ``"users"``
    (the user rule, which it checks first), ``"hosts"``, or None (a host may get two);
    None too when config.xml cannot be read."""
    try:
        # Not host data: the project's own config.xml (admin-written)
        cfg = ET.parse(config_xml).getroot().find("config")  # nosec B314
    except (OSError, ET.ParseError):
        return None
    if cfg is None:
        return None
    if boinc_bool(cfg.find(PER_USER)):
        return "users"
    return "hosts" if boinc_bool(cfg.find(PER_HOST)) else None


def wanted_flags(min_quorum: int, across: Across) -> dict[str, bool]:
    """The flags quorum needs. With ``min_quorum`` 1 a workunit is still replicated now
    and then (the work generator's spot checks for the loss check, :mod:`.spotcheck`;
    BOINC's adaptive replication): its replica must go to another host, and the user
    rule (which would leave it unsendable on a fleet attached with one account) is the
    admin's to choose."""
    if min_quorum < 2:
        return {PER_HOST: True}
    if across == "users":
        return {PER_USER: True}
    if across == "hosts":
        return {PER_USER: False, PER_HOST: True}
    raise BoincProjectError(f"--quorum-across must be 'users' or 'hosts', got {across!r}")


def set_quorum_flags(config_xml: Path, min_quorum: int, across: Across) -> list[str]:
    """Set config.xml's flags so that replicas of a workunit go to different users (or
    hosts); what changed. A flag already set as wanted, in either spelling, is kept."""
    want = wanted_flags(min_quorum, across)
    if not want:
        return []
    doc = XmlDoc.load(config_xml, "boinc")
    cfg = doc.root.find("config")
    if cfg is None:
        raise BoincProjectError(f"{config_xml}: no <config> section (not a BOINC project config?)")
    goal = across if min_quorum >= 2 else "hosts"
    for tag, value in want.items():
        el = cfg.find(tag)
        if el is not None and boinc_bool(el) == value:
            continue
        text = "1" if value else "0"
        if el is None:
            if not value:
                continue  # absent is already false
            el = ET.Element(tag)
            el.text = text
            append_child(cfg, el, 1)
            doc.changes.append(f"set <{tag}> to 1 (replicas of a workunit go to different {goal})")
        else:
            el.text = text
            doc.changes.append(f"changed <{tag}> to {text} (replicas of a workunit go to different {goal})")
    doc.save()
    return list(doc.changes)


def replicas_across(config: dict[str, str | None] | object) -> str:
    """What config.xml's flags guarantee about the replicas of a workunit: ``users``,
    ``hosts`` or ``nothing`` (``config`` has ``get(tag)``, values as read from config.xml,
    where an empty element reads as '')."""
    get = config.get  # type: ignore[attr-defined]

    def flag(tag: str) -> bool:
        raw = get(tag)
        if raw is None:
            return False
        raw = str(raw).strip()
        if not raw:
            return True
        try:
            return int(raw) != 0
        except ValueError:
            return False

    if flag(PER_USER):
        return "users"
    if flag(PER_HOST):
        return "hosts"
    return "nothing"


__all__ = ["PER_HOST", "PER_USER", "boinc_bool", "replicas_across", "set_quorum_flags", "wanted_flags"]
