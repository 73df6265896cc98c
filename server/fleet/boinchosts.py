"""What the fleet controller reads from BOINC's database: hosts, results in flight, queue.

BOINC alone knows which host runs which result (``result.hostid``, ``server_state``
4 = in progress, 2 = unsent). Every query is :class:`~boinc_dl.server.backends.boinc.boincdb.BoincDB`'s
(the one home of BOINC's SQL: read-only session, SELECT only, bounded rows); this module
holds the fleet's logic on top. A cloud instance is matched to its BOINC host(s) by, in
order of trust:

1. ``host.domain_name`` equal to the instance's name (AWS: its id ``i-...``; GCP: its
   name): the naming convention our cloud-init applies (``hostnamectl set-hostname``
   before the BOINC client first contacts the project; GCP's default hostname is the name);
2. ``host.domain_name`` equal to one of the cloud's DNS names for it;
3. ``host.last_ip_addr`` / ``host.external_ip_addr`` equal to its private or public IP.

A client attached twice has two host rows; both are taken. GCP recreates a preempted VM
under the same name, so one name may stand for several lives: the results of one life
are those sent while it existed (:meth:`BoincHosts.in_flight` with ``since``/``until``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from boinc_dl.server.backends.boinc.boincdb import (
    RESULT_SERVER_STATE_IN_PROGRESS,
    RESULT_SERVER_STATE_UNSENT,
    HostAddressRow,
    InProgressRow,
)
from boinc_dl.server.fleet.provider import Instance

#: Seconds of clock difference tolerated between BOINC's server and the cloud when a
#: result's send time is placed within an instance's life (a host boots and attaches for
#: far longer than this before its first result is sent).
LIFE_SLACK_S = 5.0


class HostQueries(Protocol):
    """The queries of BOINC's database the fleet needs (BoincDB's methods)."""

    def hosts_named(self, names: list[str], ips: list[str]) -> list[HostAddressRow]: ...

    def results_in_progress(self, app: str, host_ids: list[int]) -> list[InProgressRow]: ...

    def result_counts(self, app: str) -> dict[int, int]: ...

    def workunits_in_progress(self, app: str) -> list[str]: ...


@dataclass
class InFlight:
    """A result a host holds: its BOINC names and when it was sent."""

    result: str
    workunit: str
    host_id: int
    sent_time: float


@dataclass
class QueueDemand:
    """Results of the project's app waiting for a host or running on one."""

    unsent: int
    in_progress: int


class BoincHosts:
    """The fleet's view of BOINC's hosts and results (see module docstring)."""

    def __init__(self, db: HostQueries, app: str = "boincdl"):
        self.db = db
        self.app = app

    @classmethod
    def from_project(cls, project: object) -> BoincHosts:
        """A read-only session with the credentials of the project's ``config.xml``."""
        from boinc_dl.server.backends.boinc.boincdb import BoincDB
        from boinc_dl.server.backends.boinc.project import APP_NAME

        return cls(BoincDB.connect(project, timeout_s=30), APP_NAME)  # type: ignore[arg-type]

    def hosts_of(self, instances: list[Instance]) -> dict[str, list[int]]:
        """BOINC host ids of each instance, by its ``uid`` (see the module docstring)."""
        names = sorted({n for i in instances for n in (i.name, *i.names) if n})
        ips = sorted({ip for i in instances for ip in (i.private_ip, i.public_ip) if ip})
        if not names and not ips:
            return {}
        rows = self.db.hosts_named(names, ips)
        out: dict[str, list[int]] = {}
        for inst in instances:
            mine = {inst.name, *inst.names} - {""}
            addrs = {inst.private_ip, inst.public_ip} - {""}
            by_name = [r.id for r in rows if r.domain_name in mine]
            # an address is only trusted when no host row carries the instance's name
            hits = by_name or [r.id for r in rows if r.last_ip_addr in addrs or r.external_ip_addr in addrs]
            if hits:
                out[inst.uid] = sorted(set(hits))
        return out

    def in_flight(self, host_ids: list[int], since: float | None = None,
                  until: float | None = None) -> list[InFlight]:
        """Results of our app in progress on these hosts, sent within [since, until]
        (give an instance's life: its launch and, once known, its end)."""
        if not host_ids:
            return []
        lo = -float("inf") if since is None else since - LIFE_SLACK_S
        hi = float("inf") if until is None else until + LIFE_SLACK_S
        return [InFlight(r.result, r.workunit, r.hostid, float(r.sent_time))
                for r in self.db.results_in_progress(self.app, host_ids) if lo <= r.sent_time <= hi]

    def demand(self) -> QueueDemand:
        """Unsent and in-progress results of our app."""
        counts = self.db.result_counts(self.app)
        return QueueDemand(counts.get(RESULT_SERVER_STATE_UNSENT, 0), counts.get(RESULT_SERVER_STATE_IN_PROGRESS, 0))

    def running_workunits(self) -> list[str]:
        """Workunit names of our app's results in progress (for the cost split by job)."""
        return self.db.workunits_in_progress(self.app)
