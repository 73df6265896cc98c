"""A local stand-in for the few Compute Engine REST endpoints the GCP provider uses.

A threaded ``http.server`` answering, with the JSON shapes of the real API (v1):

* ``GET  .../zones/Z/instanceGroupManagers/M``
* ``POST .../zones/Z/instanceGroupManagers/M/resize?size=N``
* ``POST .../zones/Z/instanceGroupManagers/M/listManagedInstances``
* ``POST .../zones/Z/instanceGroupManagers/M/recreateInstances``
* ``GET  .../zones/Z/instances?filter=name eq "regex"``
* ``GET  .../zones/Z/operations?filter=operationType = "..."``

Its world: managed instance groups whose members become RUNNING on :meth:`tick`
(like a MIG's reconciliation), ``preempt`` (TERMINATED with a ``lastStopTimestamp``,
and a ``compute.instances.preempted`` operation naming the VM's ``targetId``), and
``exhausted`` (creations fail with ZONE_RESOURCE_POOL_EXHAUSTED). As a managed
instance group does, it recreates a preempted member (on a later tick, or at once on
``recreateInstances``) under the same *name* with a new instance ``id``. Every life
(id, name, creation, stop) is kept in :attr:`World.lives`: the cloud's own record that
an independent bill is computed from.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

BASE = "https://www.googleapis.com/compute/v1"


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")


class World:
    """The stand-in's state (one project, one zone)."""

    def __init__(self, project: str, zone: str, clock: Callable[[], float] = time.time):
        self.project, self.zone = project, zone
        self.clock = clock
        self.lives: dict[str, dict[str, Any]] = {}  # id -> name, mig, created, ended
        self.lock = threading.Lock()
        self.migs: dict[str, dict[str, Any]] = {}
        self.instances: dict[str, dict[str, Any]] = {}
        self.operations: list[dict[str, Any]] = []
        self.exhausted = False
        self.ids = itertools.count(1000)
        self.calls: list[tuple[str, str]] = []

    def zone_url(self) -> str:
        return f"{BASE}/projects/{self.project}/zones/{self.zone}"

    def add_mig(self, name: str, machine_type: str, size: int = 0) -> None:
        self.migs[name] = {"name": name, "base": name, "machine_type": machine_type, "target": 0, "members": []}
        self.resize(name, size)
        self.tick()

    def _t(self) -> float:
        """Now, to the millisecond (the API's timestamps carry milliseconds)."""
        return round(self.clock(), 3)

    def _now(self) -> str:
        return _iso(self._t())

    def _new_instance(self, mig: dict[str, Any]) -> None:
        n, t = next(self.ids), self._t()
        name = f"{mig['base']}-{n:04x}"
        self.instances[name] = {
            "id": str(n), "name": name, "status": "PROVISIONING", "mig": mig["name"],
            "machine_type": mig["machine_type"], "created": _iso(t), "ip": f"10.128.{n // 256 % 256}.{n % 256}",
            "action": "CREATING", "errors": [], "stopped": ""}
        self.lives[str(n)] = {"name": name, "mig": mig["name"], "created": t, "ended": None}
        mig["members"].append(name)

    def _end_life(self, inst: dict[str, Any], t: float) -> None:
        life = self.lives[inst["id"]]
        if life["ended"] is None:
            life["ended"] = t

    def _recreate(self, inst: dict[str, Any]) -> None:
        """The group deletes the VM and creates it anew: same name, new id."""
        t = self._t()
        self._end_life(inst, t)
        n = next(self.ids)
        inst.update(id=str(n), status="PROVISIONING", action="RECREATING", created=_iso(t), stopped="")
        self.lives[str(n)] = {"name": inst["name"], "mig": inst["mig"], "created": t, "ended": None}

    def resize(self, name: str, size: int) -> None:
        mig = self.migs[name]
        mig["target"] = size
        while len(mig["members"]) < size:
            self._new_instance(mig)
        while len(mig["members"]) > size:
            gone = mig["members"].pop()
            inst = self.instances.pop(gone, None)
            if inst:
                self._end_life(inst, self._t())

    def tick(self) -> None:
        """Reconcile: creations finish (or fail while exhausted), preempted members come back."""
        for inst in self.instances.values():
            if inst["action"] in ("CREATING", "RECREATING"):
                if self.exhausted:
                    inst["errors"] = [{"code": "ZONE_RESOURCE_POOL_EXHAUSTED",
                                       "message": f"The zone '{self.zone_url()}' does not have enough resources "
                                                  "available to fulfill the request."}]
                    continue
                inst.update(status="RUNNING", action="NONE", errors=[], created=inst["created"])
            elif inst["status"] == "TERMINATED":
                self._recreate(inst)

    def preempt(self, name: str) -> None:
        inst = self.instances[name]
        t = self._t()  # one reading: the VM's stop, the operation and the life's record agree
        now = _iso(t)
        inst.update(status="TERMINATED", stopped=now)
        self._end_life(inst, t)
        n = next(self.ids)
        self.operations.append({
            "kind": "compute#operation", "id": str(n), "name": f"systemevent-{n}",
            "zone": self.zone_url(), "operationType": "compute.instances.preempted",
            "targetLink": f"{self.zone_url()}/instances/{name}", "targetId": inst["id"],
            "status": "DONE", "statusMessage": "Instance was preempted.", "user": "system",
            "progress": 100, "insertTime": now, "startTime": now, "endTime": now,
            "selfLink": f"{self.zone_url()}/operations/systemevent-{n}"})

    def recreate(self, mig: str, urls: list[str]) -> None:
        for u in urls:
            inst = self.instances.get(u.rsplit("/", 1)[-1])
            if inst and inst["mig"] == mig:
                self._recreate(inst)

    # ---- JSON shapes -------------------------------------------------------------------------
    def mig_json(self, name: str) -> dict[str, Any]:
        m = self.migs[name]
        return {"kind": "compute#instanceGroupManager", "id": str(abs(hash(name)) % 10**12), "name": name,
                "zone": self.zone_url(), "baseInstanceName": m["base"], "targetSize": m["target"],
                "instanceTemplate": f"{BASE}/projects/{self.project}/global/instanceTemplates/{name}-tpl",
                "selfLink": f"{self.zone_url()}/instanceGroupManagers/{name}",
                "currentActions": {"none": sum(self.instances[i]["action"] == "NONE" for i in m["members"]),
                                   "creating": sum(self.instances[i]["action"] == "CREATING" for i in m["members"])}}

    def managed_json(self, name: str) -> list[dict[str, Any]]:
        out = []
        for i in self.migs[name]["members"]:
            inst = self.instances[i]
            d: dict[str, Any] = {"instance": f"{self.zone_url()}/instances/{i}", "id": inst["id"],
                                 "currentAction": inst["action"], "name": i}
            if inst["action"] not in ("CREATING",):
                d["instanceStatus"] = inst["status"]
            if inst["errors"]:
                d["lastAttempt"] = {"errors": {"errors": inst["errors"]}}
            out.append(d)
        return out

    def instance_json(self, inst: dict[str, Any]) -> dict[str, Any]:
        extra = {"lastStopTimestamp": inst["stopped"]} if inst["stopped"] else {}
        return {"kind": "compute#instance", "id": inst["id"], "name": inst["name"], "status": inst["status"],
                "creationTimestamp": inst["created"], "zone": self.zone_url(), **extra,
                "machineType": f"{self.zone_url()}/machineTypes/{inst['machine_type']}",
                "scheduling": {"provisioningModel": "SPOT" if "spot" in inst["mig"] else "STANDARD"},
                "networkInterfaces": [{"name": "nic0", "networkIP": inst["ip"], "accessConfigs": []}],
                "selfLink": f"{self.zone_url()}/instances/{inst['name']}"}

    def operation(self, kind: str, target: str) -> dict[str, Any]:
        n = next(self.ids)
        return {"kind": "compute#operation", "id": str(n), "name": f"operation-{n}", "zone": self.zone_url(),
                "operationType": kind, "targetLink": target, "status": "DONE", "progress": 100,
                "insertTime": self._now(), "selfLink": f"{self.zone_url()}/operations/operation-{n}"}


def _filter(expr: str) -> tuple[str, str] | None:
    """``field eq "regex"`` or ``field = "value"`` -> (field, regex)."""
    m = re.match(r'^\s*(\w+)\s+(eq|=)\s+"(.*)"\s*$', expr)
    if not m:
        return None
    return m.group(1), (m.group(3) if m.group(2) == "eq" else re.escape(m.group(3)))


class _Handler(BaseHTTPRequestHandler):
    world: World

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, msg: str) -> None:
        self._send(code, {"error": {"code": code, "message": msg, "errors": [{"message": msg, "reason": "notFound"}]}})

    def _route(self, method: str) -> None:
        w = self.world
        u = urlparse(self.path)
        q = {k: v[0] for k, v in parse_qs(u.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}") if length else {}
        m = re.match(r"^/compute/v1/projects/([^/]+)/zones/([^/]+)/(.*)$", u.path)
        if not m or m.group(1) != w.project or m.group(2) != w.zone:
            return self._error(404, f"unknown resource {u.path}")
        rest = m.group(3).split("/")
        with w.lock:
            w.calls.append((method, m.group(3)))
            if rest[0] == "instanceGroupManagers" and len(rest) >= 2:
                mig = rest[1]
                if mig not in w.migs:
                    return self._error(404, f"The resource 'instanceGroupManagers/{mig}' was not found")
                target = f"{w.zone_url()}/instanceGroupManagers/{mig}"
                if len(rest) == 2 and method == "GET":
                    return self._send(200, w.mig_json(mig))
                if rest[2:] == ["resize"] and method == "POST":
                    w.resize(mig, int(q["size"]))
                    return self._send(200, w.operation("compute.instanceGroupManagers.resize", target))
                if rest[2:] == ["listManagedInstances"] and method == "POST":
                    return self._send(200, {"managedInstances": w.managed_json(mig)})
                if rest[2:] == ["recreateInstances"] and method == "POST":
                    w.recreate(mig, list(body.get("instances", [])))
                    return self._send(200, w.operation("compute.instanceGroupManagers.recreateInstances", target))
            if rest == ["instances"] and method == "GET":
                items = list(w.instances.values())
                f = _filter(q.get("filter", "")) if q.get("filter") else None
                if f:
                    key = {"name": "name"}.get(f[0], f[0])
                    items = [i for i in items if re.fullmatch(f[1], str(i.get(key, "")))]
                return self._send(200, {"kind": "compute#instanceList", "id": f"projects/{w.project}/zones/{w.zone}/instances",
                                        "items": [w.instance_json(i) for i in items]})
            if rest == ["operations"] and method == "GET":
                ops = w.operations
                f = _filter(q.get("filter", "")) if q.get("filter") else None
                if f:
                    ops = [o for o in ops if re.fullmatch(f[1], str(o.get(f[0], "")))]
                return self._send(200, {"kind": "compute#operationList", "items": ops})
        return self._error(404, f"no such method {method} {u.path}")

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._route("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._route("POST")


class GcpStandin:
    """Start/stop the stand-in on 127.0.0.1 and a free port."""

    def __init__(self, world: World):
        handler = type("Handler", (_Handler,), {"world": world})
        self.world = world
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> GcpStandin:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
