"""What the fleet controller reads from BOINC's database: hosts, results in flight, queue.

BOINC alone knows which host runs which result (``result.hostid``, ``server_state``
4 = in progress, 2 = unsent). A cloud instance is matched to its BOINC host(s) by,
in order of trust:

1. ``host.domain_name`` equal to the instance's id (AWS ``i-...``) or name (GCP): the
   naming convention our cloud-init applies (``hostnamectl set-hostname <id>`` before
   the BOINC client first contacts the project; GCP's default hostname is the name);
2. ``host.domain_name`` equal to one of the cloud's DNS names for it;
3. ``host.last_ip_addr`` / ``host.external_ip_addr`` equal to its private or public IP.

A client attached twice has two host rows; both are taken. Read-only: the controller
never writes BOINC's database (re-issue goes through the work generator).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from boinc_dl.server.fleet.provider import Instance

UNSENT, IN_PROGRESS = 2, 4


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
    """Queries on a DB-API connection to BOINC's database (MySQL/MariaDB in production)."""

    def __init__(self, conn: Any, app: str = "boincdl", paramstyle: str = "format"):
        self.conn = conn
        self.app = app
        self.mark = "?" if paramstyle == "qmark" else "%s"

    @classmethod
    def from_project(cls, project: Any) -> BoincHosts:
        """A read-only session with the credentials of the project's ``config.xml``
        (:class:`~boinc_dl.server.backends.boinc.boincdb.BoincDB`: db_host/db_port/db_socket as BOINC reads them)."""
        from boinc_dl.server.backends.boinc.boincdb import BoincDB
        from boinc_dl.server.backends.boinc.project import APP_NAME

        return cls(BoincDB.connect(project, timeout_s=30).conn, APP_NAME, "format")

    def _rows(self, sql: str, args: Iterable[Any] = ()) -> list[tuple]:
        cur = self.conn.cursor()
        try:
            cur.execute(sql.replace("?", self.mark), tuple(args))
            return list(cur.fetchall())
        finally:
            cur.close()

    def hosts_of(self, instances: list[Instance]) -> dict[str, list[int]]:
        """BOINC host ids of each instance (see the module docstring for the matching)."""
        names = {n for i in instances for n in (i.id, *i.names) if n}
        ips = {ip for i in instances for ip in (i.private_ip, i.public_ip) if ip}
        if not names and not ips:
            return {}
        conds, args = [], []
        if names:
            conds.append(f"domain_name IN ({','.join('?' * len(names))})")
            args += sorted(names)
        if ips:
            marks = ",".join("?" * len(ips))
            conds.append(f"last_ip_addr IN ({marks}) OR external_ip_addr IN ({marks})")
            args += sorted(ips) * 2
        # Only placeholders are formatted in; every value is a bound parameter.
        rows = self._rows(f"SELECT id, domain_name, last_ip_addr, external_ip_addr FROM host WHERE {' OR '.join(conds)}",  # nosec B608
                          args)
        out: dict[str, list[int]] = {}
        for inst in instances:
            mine = {inst.id, *inst.names} - {""}
            addrs = {inst.private_ip, inst.public_ip} - {""}
            by_name = [r[0] for r in rows if r[1] in mine]
            hits = by_name or [r[0] for r in rows if r[2] in addrs or r[3] in addrs]
            if hits:
                out[inst.id] = sorted(set(hits))
        return out

    def in_flight(self, host_ids: list[int]) -> list[InFlight]:
        """Results of our app in progress on these hosts."""
        if not host_ids:
            return []
        rows = self._rows(
            "SELECT r.name, w.name, r.hostid, r.sent_time FROM result r JOIN workunit w ON r.workunitid = w.id "
            f"JOIN app a ON r.appid = a.id WHERE a.name = ? AND r.server_state = ? "
            f"AND r.hostid IN ({','.join('?' * len(host_ids))})",  # nosec B608 - placeholders only, values bound
            [self.app, IN_PROGRESS, *host_ids])
        return [InFlight(str(r[0]), str(r[1]), int(r[2]), float(r[3] or 0)) for r in rows]

    def demand(self) -> QueueDemand:
        """Unsent and in-progress results of our app."""
        rows = self._rows("SELECT r.server_state, COUNT(*) FROM result r JOIN app a ON r.appid = a.id "
                          "WHERE a.name = ? AND r.server_state IN (?, ?) GROUP BY r.server_state",
                          [self.app, UNSENT, IN_PROGRESS])
        counts = {int(s): int(n) for s, n in rows}
        return QueueDemand(counts.get(UNSENT, 0), counts.get(IN_PROGRESS, 0))

    def running_workunits(self) -> list[str]:
        """Workunit names of our app's results in progress (for the cost split by job)."""
        return [str(r[0]) for r in self._rows(
            "SELECT w.name FROM result r JOIN workunit w ON r.workunitid = w.id JOIN app a ON r.appid = a.id "
            "WHERE a.name = ? AND r.server_state = ?", [self.app, IN_PROGRESS])]
