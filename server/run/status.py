"""``boinc-dl status``: a job's state gathered from Redis, and its terminal rendering."""

from __future__ import annotations

import json
import socket
import time
from collections import Counter
from typing import Any

from rich.console import Console
from rich.table import Table

from boinc_dl.server.assimilator import losscheck as lc
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.boinc.spotcheck import spot_checks
from boinc_dl.server.common.errors import BoincDLError
from boinc_dl.server.common.procs import pid_alive
from boinc_dl.server.common.spec import spec_from_json
from boinc_dl.server.run.jobclock import RUN_COUNTERS, describe_runs

#: A running job's owner (``boinc-dl run``) writes ``heartbeat_at`` about twice a
#: second; one older than this means the process that ran it is gone (crashed,
#: killed, its machine lost).
HEARTBEAT_STALE_S = 30.0


def effective_status(meta: dict[str, str], now: float | None = None) -> tuple[str, str]:
    """(status, reason): a job recorded as running whose owner is gone is *crashed* —
    its process is dead (same machine) or its heartbeat stopped."""
    status, reason = meta.get("status", "?"), meta.get("reason", "")
    if status != "running" or "heartbeat_at" not in meta:
        return status, reason
    now = time.time() if now is None else now
    try:
        beat, pid = float(meta["heartbeat_at"]), int(meta.get("owner_pid", 0))
    except ValueError:
        return status, reason
    if meta.get("owner_host") == socket.gethostname() and pid and not pid_alive(pid):
        return "crashed", f"its process {pid} is gone (last heartbeat {now - beat:.0f} s ago); continue with --resume"
    if now - beat > HEARTBEAT_STALE_S:
        return "crashed", f"no heartbeat for {now - beat:.0f} s; continue with --resume"
    return status, reason


def job_status(store: JobStore) -> dict[str, Any]:
    """Everything ``status`` shows, as plain data (also used by ``--json``)."""
    meta = store.meta()
    status, reason = effective_status(meta)
    epochs = store.epochs()
    states = Counter(store.unit_states().values())
    last = epochs[max(epochs)] if epochs else {}
    text = ""
    try:
        text = store.spec_json()
        spec = json.loads(text)
        total = int(spec["training"]["epochs"])
    except (BoincDLError, ValueError, KeyError, TypeError):
        spec, total = {}, None
    limit = (spec.get("validation") or {}).get("loss_ledger_limit") if isinstance(spec, dict) else None
    # the held-out loss check (VC-ASGD on BOINC): how many trusted results it has measured
    # of those it needs before it refuses anything
    check = None
    if meta.get("backend") == "boinc" and spec:
        try:
            job_spec = spec_from_json(text)
        except ValueError:  # a spec this release cannot read (pydantic's error is a ValueError)
            job_spec = None
        if job_spec is not None and lc.enabled(job_spec):
            check = {"trusted": store.trusted_count("0", lc.STAT), "needed": lc.trusted_needed(job_spec)}
    return {
        "job": store.job,
        "epochs_total": total,
        "status": status,
        "mode": meta.get("mode", "?"),
        "reason": reason,
        "epoch": int(float(meta.get("epoch", 0))),
        "closed_epochs": len(epochs),
        "latest_val_acc": last.get("val_acc"),
        "best_val_acc": max((e["val_acc"] for e in epochs.values()), default=None),
        "units": dict(states),
        "counters": store.counters(),
        # seconds `boinc-dl run` processes have trained the job, over every resume
        "run_time_s": _float(meta.get("active_s")),
        "weights_version": {m: store.version(m) for m in store.models()},
        "rejections": store.rejections(10),
        # the hosts' loss ledgers (BOINC host id -> balance; refused past the limit)
        "ledgers": {m: b for m in store.models() if (b := store.ledger_balances(m))},
        "ledger_limit": limit,
        # untrusted results judged against trusted changes from worse models (the
        # project replicates too little for the loss check to follow the model)
        "loss_checks_stale": store.loss_checks_stale(),
        "loss_check": check,
        # units the BOINC work generator replicated for the loss check, by why
        "spot_checks": dict(Counter(c.get("why", "?") for c in spot_checks(store).values())),
        "failed": store.failed(),
        "epochs": epochs,
    }


def render_status(console: Console, st: dict[str, Any]) -> None:
    """Print a status dict as a compact table plus recent rejections."""
    t = Table(title=f"job {st['job']} ({st['mode']}): {st['status']}", show_header=False)
    if st["reason"]:
        t.add_row("why", st["reason"])
    if st.get("run_dir"):
        t.add_row("run directory", str(st["run_dir"]))
    total = st.get("epochs_total")
    of = f" / {total}" if total else ""
    if st["status"] in ("running",) and st["epoch"] > st["closed_epochs"]:
        t.add_row("epochs", f"{st['closed_epochs']}{of} closed, training epoch {st['closed_epochs'] + 1}")
    else:
        t.add_row("epochs", f"{st['closed_epochs']}{of} closed")
    u = st["units"]
    t.add_row("units", ", ".join(f"{k} {v}" for k, v in sorted(u.items())) or "none")
    acc = st["latest_val_acc"]
    t.add_row("latest val accuracy", f"{acc:.4f}" if acc is not None else "-")
    if st["best_val_acc"] is not None:
        t.add_row("best val accuracy", f"{st['best_val_acc']:.4f}")
    t.add_row("weights versions", ", ".join(f"{m}: {v}" for m, v in st["weights_version"].items()) or "-")
    counters = st["counters"]
    if counters.get("runs"):  # a local run's job: the runs that trained it, in words
        t.add_row("runs", describe_runs({**counters, "active_s": st.get("run_time_s") or 0.0}))
    c = {k: v for k, v in counters.items() if k not in RUN_COUNTERS}
    if c:
        t.add_row("counters", ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    check = st.get("loss_check")
    if check and check["trusted"] < check["needed"]:
        t.add_row("loss check", f"not active yet: {check['trusted']} of {check['needed']} trusted (replicated) "
                  "results measured; until then every result merges unchecked")
    stale = sum(st.get("loss_checks_stale", {}).values())
    if stale:
        t.add_row("loss check", f"{stale} result(s) judged against trusted results from worse models: "
                  "replicate more to keep the check and the hosts' ledgers comparable (docs/merge-rules.md)")
    spots = st.get("spot_checks") or {}
    if spots:
        t.add_row("spot checks", f"{sum(spots.values())} unit(s) replicated for the loss check: "
                  f"{spots.get('bootstrap', 0)} until enough trusted results, "
                  f"{spots.get('stale', 0)} after results judged against worse models")
    console.print(t)
    if st["rejections"]:
        r = Table(title="recent rejected results", show_lines=False)
        # Unit names and hosts whole (a user greps for them); the reason wraps, long words folded.
        r.add_column("when", no_wrap=True)
        r.add_column("unit", no_wrap=True)
        hosts = any(x.get("host_id") for x in st["rejections"])
        if hosts:  # BOINC's host ids, as the ledgers below name them
            r.add_column("host", no_wrap=True)
        r.add_column("reason", overflow="fold")
        for x in st["rejections"]:
            r.add_row(time.strftime("%H:%M:%S", time.localtime(x.get("t", 0))), x.get("unit", ""),
                      *([str(x.get("host_id") or "")] if hosts else []), x.get("reason", ""))
        console.print(r)
    ledgers = [(m, h, b) for m, hosts in st.get("ledgers", {}).items() for h, b in hosts.items() if b > 0]
    if ledgers:
        limit = st.get("ledger_limit")
        led = Table(title="hosts' loss ledgers (balance past the limit: results refused)" if limit is None else
                    f"hosts' loss ledgers (results refused past {limit:g})")
        led.add_column("host", no_wrap=True)
        led.add_column("model")
        led.add_column("balance")
        for m, h, b in sorted(ledgers, key=lambda x: -x[2])[:10]:
            led.add_row(h, m, f"{b:.2f}")
        console.print(led)
    if st["failed"]:
        f = Table(title="units given up on")
        f.add_column("unit", no_wrap=True)
        f.add_column("reason", overflow="fold")
        for k, v in sorted(st["failed"].items())[:10]:
            f.add_row(k, v)
        console.print(f)


def _float(value: str | None) -> float | None:
    """A meta field as a number (``None`` when absent or not a number)."""
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
