"""BOINC's view of the hosts that are asking for work: how many units to keep in flight.

VC-ASGD keeps a bounded window of units in flight so that each new unit starts from fresh
server weights. On BOINC the generator never sees hosts, so the window is sized from
BOINC's database: hosts whose last scheduler RPC (``host.rpc_time``) is recent, and their
CPU count (``host.p_ncpus``). Each active host gets its slots plus one spare unit, so a host
that reports a result in the same RPC as it asks for work finds its next unit already
waiting instead of a "no tasks" reply (and a work-fetch backoff). The spec's
``vcasgd.window`` (or the project's ``capacity``) bounds the result.

With ``<next_rpc_delay>`` set (:mod:`boinc_dl.server.backends.boinc.host_contact`) every live host contacts
the scheduler at least that often, so a host silent for three such periods is gone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from boinc_dl.server.backends.boinc.boincdb import BoincDB, BoincDBError, HostRow, credentials
from boinc_dl.server.backends.boinc.project import BoincProject

log = logging.getLogger(__name__)

#: Hosts silent for longer than this are not counted when config.xml sets no next_rpc_delay.
DEFAULT_ACTIVE_S = 3600.0
#: Seconds between two reads of the host table by one work generator.
CACHE_S = 30.0


def active_window(hosts: Iterable[HostRow], now: float, active_s: float, spare_per_host: int = 1) -> int:
    """Units to keep in flight for the hosts heard from within ``active_s``: their slots
    plus ``spare_per_host`` each (0 when no host is active)."""
    n = slots = 0
    for h in hosts:
        if now - h.rpc_time <= active_s:
            n += 1
            slots += max(1, int(h.p_ncpus))
    return slots + spare_per_host * n if n else 0


def active_seconds(project: BoincProject) -> float:
    """How recent a host's last RPC must be to count: 3 x next_rpc_delay (at least 3 min)."""
    try:
        d = float(project.config.get("next_rpc_delay") or 0)
    except ValueError:
        d = 0.0
    return max(180.0, 3 * d) if d > 0 else DEFAULT_ACTIVE_S


def db_params(project: BoincProject) -> dict[str, object] | None:
    """PyMySQL connection arguments from config.xml (``db_host[:port]``, ``db_port``,
    ``db_socket``, ``db_user``, ``db_passwd``, ``db_name``), as
    :func:`~boinc_dl.server.backends.boinc.boincdb.credentials` reads them; None when config.xml
    names no database."""
    try:
        args: dict[str, object] = dict(credentials(project))
    except BoincDBError:
        return None
    args.setdefault("port", 3306)
    args.update(connect_timeout=5, read_timeout=10)
    return args


def read_hosts(project: BoincProject, active_s: float) -> list[HostRow]:
    """Hosts of the project heard from within ``active_s`` seconds, through the read-only,
    bounded :class:`~boinc_dl.server.backends.boinc.boincdb.BoincDB`."""
    with BoincDB.connect(project, timeout_s=5.0) as db:
        return db.active_hosts(active_s)


class HostCensus:
    """Cached :func:`active_window` of a project's database (None when unreadable)."""

    def __init__(self, project: BoincProject, cache_s: float = CACHE_S, spare_per_host: int = 1):
        self.project = project
        self.cache_s = cache_s
        self.spare_per_host = spare_per_host
        self._at = -float("inf")
        self._value: int | None = None
        self._hosts: int | None = None
        self._warned = False

    def hosts(self) -> int | None:
        """Hosts heard from recently (as :meth:`window` counts them); None if the DB is unreadable."""
        self.window()
        return self._hosts

    def window(self) -> int | None:
        """Units in flight that the active hosts can take now; None if the DB is unreadable."""
        now = time.monotonic()
        if now - self._at < self.cache_s:
            return self._value
        self._at = now
        wall = time.time()
        active_s = active_seconds(self.project)
        try:
            rows = read_hosts(self.project, active_s)
        except Exception as e:  # noqa: BLE001 - any DB/driver failure: fall back, say so once
            if not self._warned:
                log.warning("cannot read BOINC's host table (%s): window from the spec instead", e)
                self._warned = True
            self._value = self._hosts = None
            return None
        self._warned = False
        self._value = active_window(rows, wall, active_s, self.spare_per_host)
        self._hosts = sum(1 for h in rows if wall - h.rpc_time <= active_s)
        return self._value
