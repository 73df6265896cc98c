"""MOP model selection's own state in Redis: its keys and every command on them.

Keys of job J (through the job store's namespace; one slot in a Redis Cluster):

==========================  ============================================================
``bdl:J:configs``           hash model -> its configuration record (hyper-parameters,
                            status, parent, reason)
``bdl:J:mop_sched``         the scheduler's state (JSON; written with the units it issued)
``bdl:J:mop_log``           list: every finished assignment, in order (reproducibility)
``bdl:J:mop_logged``        hash unit -> 1: the units already in ``mop_log`` (once each)
``bdl:J:mop_model_results`` hash ``"<epoch>:<model>"`` -> a model's end-of-epoch metrics
``bdl:J:mop_results``       hash epoch -> every model's metrics of a closed epoch
==========================  ============================================================

The units MOP creates, their states and the models' weights and optimizer state are
the job store's (:class:`~boinc_dl.server.assimilator.store.JobStore`).
"""

from __future__ import annotations

import json
from typing import Any

from boinc_dl.server.assimilator.store import JobStore

# Append a finished assignment to the log unless its unit is there already: the log is
# written before the scheduler's state that says the assignment finished, so a generator
# killed in between finds the assignment in flight again after its restart.
LOG_ONCE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], 1) == 1 then redis.call('RPUSH', KEYS[2], ARGV[2]) return 1 end
return 0
"""


class MopState:
    """The MOP state of one job."""

    def __init__(self, store: JobStore):
        self.store = store
        self.configs_key = store.k("configs")
        self.sched_key = store.k("mop_sched")
        self.log_key = store.k("mop_log")
        self.logged_key = store.k("mop_logged")
        self.model_results_key = store.k("mop_model_results")
        self.results_key = store.k("mop_results")

    @property
    def _r(self) -> Any:
        return self.store.r

    # ---- configurations ---------------------------------------------------------------------
    def configs(self) -> dict[str, dict[str, Any]]:
        raw = self.store.call(lambda: self._r.hgetall(self.configs_key))
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    def config(self, cid: str) -> dict[str, Any]:
        """One configuration's record (a single HGET: this is on the unit-creation path)."""
        cur = self.store.call(lambda: self._r.hget(self.configs_key, cid))
        return json.loads(cur) if cur else {}

    def put_config(self, cid: str, record: dict[str, Any]) -> None:
        self.store.call(lambda: self._r.hset(self.configs_key, cid, json.dumps(record)))

    def update_config(self, cid: str, **fields: Any) -> None:
        d = self.config(cid)
        d.update(fields)
        self.put_config(cid, d)

    # ---- scheduler state ------------------------------------------------------------------------
    def sched(self) -> dict[str, Any] | None:
        raw = self.store.call(lambda: self._r.get(self.sched_key))
        return json.loads(raw) if raw is not None else None

    def save_sched(self, state: dict[str, Any], pipe: Any | None = None) -> None:
        """Save the scheduler's state (inside ``pipe``'s transaction when given)."""
        text = json.dumps(state)
        if pipe is not None:
            pipe.set(self.sched_key, text)
        else:
            self.store.call(lambda: self._r.set(self.sched_key, text))

    # ---- the finished-assignment log --------------------------------------------------------------
    def log_assignment(self, unit: str, record: dict[str, Any]) -> bool:
        """Append ``unit``'s finished assignment to the log, once: False when it is there
        already (a restarted generator seeing the same completion again)."""
        text = json.dumps(record)
        return bool(self.store.call(lambda: self._r.eval(LOG_ONCE, 2, self.logged_key, self.log_key, unit, text)))

    def schedule_log(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.store.call(lambda: self._r.lrange(self.log_key, 0, -1))]

    # ---- results ------------------------------------------------------------------------------
    def has_model_result(self, epoch: int, model: str) -> bool:
        return bool(self.store.call(lambda: self._r.hexists(self.model_results_key, f"{epoch}:{model}")))

    def put_model_result(self, epoch: int, model: str, result: dict[str, Any]) -> None:
        self.store.call(lambda: self._r.hset(self.model_results_key, f"{epoch}:{model}", json.dumps(result)))

    def model_results(self, epoch: int, models: list[str]) -> list[dict[str, Any] | None]:
        """Each model's end-of-``epoch`` result (None where missing), in order."""
        if not models:
            return []
        raw = self.store.call(lambda: self._r.hmget(self.model_results_key, [f"{epoch}:{m}" for m in models]))
        return [json.loads(r) if r is not None else None for r in raw]

    def put_results(self, epoch: int, results: dict[str, Any]) -> None:
        self.store.call(lambda: self._r.hset(self.results_key, epoch, json.dumps(results)))

    def results(self) -> dict[int, dict[str, dict[str, Any]]]:
        raw = self.store.call(lambda: self._r.hgetall(self.results_key))
        return dict(sorted((int(k), json.loads(v)) for k, v in raw.items()))
