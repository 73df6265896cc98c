"""The held-out loss check (Zeno++'s zeroth-order test), as the merge path uses it.

An untrusted result's update ``d = scale * (W_c - W_b)`` (clipped as the merge will
apply it) is refused when it raises the loss of a held-out batch by more than the upper
tail of the same change over *trusted* results::

    L(W_b + d) - L(W_b) > median + k * 1.4826 * MAD   (of the latest 32 trusted increases
                                                        measured from a base about as good)

(:func:`~boinc_dl.server.assimilator.rules.loss_increase_bound`; a loss that does not
rise always passes; with fewer than ``loss_check_min_trusted`` trusted increases there
is no bound and every result passes; with fewer comparable ones, the latest with the
median taken no lower than 0).

The forward pass needs TensorFlow, which neither the merge nor BOINC's per-result
assimilator processes may import. It runs in the long-lived work generator (a checker
thread, :mod:`boinc_dl.server.work_generator.losscheck`), and the two talk through
Redis (:class:`~boinc_dl.server.assimilator.store.JobStore`, keys ``losscheck:*``):

1. The assimilator, for an untrusted result, after its merge plan (clip scale, base)
   and before the first shard, looks up the result's verdict. Without one it hands
   the checker a hard link of the result's weights file in the job's ``loss_check/``
   directory and queues a request: once (a result's id is in the queue at most once, and
   keeps its place there when the result is delivered again; a request the checker took
   more than the wait ago without answering is presumed lost with a checker that died,
   and replaced), then waits for the verdict up to ``loss_check_wait_s`` (woken by the
   checker's notice).
2. The checker pops the request, reads the file with the bounded, fingerprint-checked
   weights reader, computes the loss change (``L(W_b)`` cached per base file), and
   sets the verdict with first-writer-wins semantics, so a retried or replayed request
   never flips it.
3. A refusal is a :class:`ResultRejected` with the numbers (the framework records it
   and, on BOINC, gives the unit up). No verdict in time is :class:`VerdictPending`, a
   :class:`StoreUnavailable`: the transport keeps the result and hands it over again
   later, as for a Redis outage; the checker's verdict is then waiting for it.

The host's ledger (:func:`settle`, :class:`~boinc_dl.server.assimilator.rules.LossLedger`)
adds up what the check sees per host (BOINC's host id, passed with the request): a result
inside the bound is still refused when its host's untrusted results together sit too far
above trusted results' median; its balance is written with the verdict, once.

Trusted results are never held back: they are queued as observations (no verdict,
nobody waits) and their loss change joins the trusted statistic. Only trusted results
feed it: a defence must not learn from the attacker. Observations are queued only while
a checker's heartbeat is live (the local backend, whose results are all trusted, runs
none and queues nothing).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

from boinc_dl.server.assimilator import rules
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.errors import ResultRejected, StoreUnavailable
from boinc_dl.server.common.paths import confined, is_safe_name
from boinc_dl.server.common.spec import JobSpec

log = logging.getLogger(__name__)

#: The trusted statistic the bound is computed from (per model).
STAT = "loss_increase"
#: Trusted increases the bound and the ledgers follow (the latest ones: rules.loss_increase_threshold, rules.loss_increase_bound).
WINDOW = 32
#: Requests the queue may hold; past it a request waits for room (the assimilator's
#: poll retries) and an observation is dropped.
MAX_QUEUE = 1024
#: A verdict outlives any retry of its result by far (BOINC retries within hours).
VERDICT_TTL_S = 7 * 86400
#: The checker's heartbeat lives this long unless refreshed (it beats every second).
HEARTBEAT_TTL_S = 15.0
#: Where the result files handed to the checker wait, inside the job's directory.
SPOOL = "loss_check"
#: A waiting assimilator wakes on the checker's notice, and looks the verdict up at
#: least this often anyway (another delivery of the same result may take the notice).
NOTICE_SLICE_S = 0.5


class VerdictPending(StoreUnavailable):
    """The loss check has not answered within the wait: a transient fault (the result is
    handed over again later, and its verdict is then looked up)."""


def enabled(spec: JobSpec) -> bool:
    """Whether results of ``spec``'s job go through the loss check (VC-ASGD: MOP's
    models each have an architecture of their own; see docs/merge-rules.md)."""
    return spec.validation.loss_check and spec.mode == "vcasgd"


def trusted_needed(spec: JobSpec) -> int:
    """Trusted loss changes the check needs before it judges anything (the bound takes them
    from the latest WINDOW, so never more than that)."""
    return min(spec.validation.loss_check_min_trusted, WINDOW)


def request_id(unit: str, attempt: int | None, result: str) -> str:
    """The identity of one result for the check: its unit, the attempt it answers and the
    job system's result name (a re-delivery of the same result maps to the same id)."""
    return hashlib.sha256(f"{unit}\0{attempt}\0{result}".encode()).hexdigest()[:32]


def threshold(spec: JobSpec) -> rules.TrustedStatistic:
    """The bound's estimator with the job's settings (not frozen: docs/merge-rules.md)."""
    v = spec.validation
    return rules.loss_increase_threshold(k=v.loss_check_k, min_samples=v.loss_check_min_trusted, window=WINDOW)


def bound_of(store: JobStore, spec: JobSpec, model: str, epoch: int) -> float | None:
    """The bound on the loss increase from every trusted change of ``model`` (None: too
    few trusted ones): whether a result can be checked at all."""
    th = threshold(spec)
    th.values = store.trusted_values(model, STAT, th.window)
    return th.value(epoch)


def bound_for(store: JobStore, spec: JobSpec, model: str, epoch: int,
              base_loss: float | None) -> tuple[float | None, bool]:
    """The bound on the loss increase of a result whose base has held-out loss
    ``base_loss``, and whether it was made of comparable trusted changes (measured from a
    base about as good: :func:`rules.loss_increase_bound`)."""
    v = spec.validation
    return rules.loss_increase_bound(store.trusted_entries(model, STAT, WINDOW), epoch, base_loss,
                                     k=v.loss_check_k, min_samples=v.loss_check_min_trusted)


def ledger_of(spec: JobSpec) -> rules.LossLedger | None:
    """The hosts' loss ledger with the job's settings (None: ``validation.loss_ledger`` off)."""
    v = spec.validation
    if not v.loss_ledger:
        return None
    return rules.LossLedger(slack=v.loss_ledger_slack, limit=v.loss_ledger_limit)


def settle(store: JobStore, spec: JobSpec, rid: str, request: dict[str, Any],
           verdict: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """Record the checker's verdict on an untrusted result, after the result's host's
    ledger (:class:`~boinc_dl.server.assimilator.rules.LossLedger`) has had its say: the
    result is refused when its host's balance would pass the limit, and the balance moves
    with the verdict in one script, once (a verdict already set, by an earlier delivery's
    check or a checker that died after writing it, is returned untouched).

    The host is the job system's id of the host that computed the result (BOINC's
    ``result.hostid``, from BOINC's database), never a string from the result file; a
    request without one (a host BOINC did not name) is judged by the per-result bound alone.
    The result is scored against trusted changes measured from a base about as good as its
    own (:meth:`~boinc_dl.server.assimilator.rules.LossLedger.reference`, the verdict's
    ``base_loss``); with too few of them, against the latest ones from a centre no lower
    than 0 (only a rising loss is charged), and counted (:meth:`JobStore.loss_checks_stale`).
    Returns what :meth:`JobStore.set_loss_verdict` returns."""
    ledger = ledger_of(spec)
    host = request.get("host")
    model = str(request.get("model", "0"))
    x = verdict.get("loss_increase")
    # judged against trusted changes from worse models (the bound or the ledger's
    # reference): counted for `boinc-dl status`, with the verdict
    stale = model if verdict.get("bound") is not None and verdict.get("bound_comparable") is False else None
    if ledger is None or not (isinstance(host, str) and host and is_safe_name(host)):
        return store.set_loss_verdict(rid, verdict, VERDICT_TTL_S, stale_model=stale)
    base_loss = verdict.get("base_loss")
    base = float(base_loss) if isinstance(base_loss, (int, float)) else None
    reference = ledger.reference(store.trusted_entries(model, STAT, WINDOW), int(request.get("epoch", 0)), base)
    comparable = reference.comparable
    # a result whose loss change is not finite (or could not be measured: an unreadable
    # upload) is worse than any trusted one, whatever the reference
    z = ledger.score(float(x), reference, base_loss=base) if x is not None else math.inf
    if z is None:  # fewer trusted changes than the ledger's window: it waits
        return store.set_loss_verdict(rid, verdict, VERDICT_TTL_S, stale_model=stale)
    if not comparable:
        stale = model
    while True:
        raw = store.ledger_balance(model, str(host))
        before = float(raw) if raw is not None else 0.0
        balance, ok = ledger.step(before, z)
        v = {**verdict, "ledger_host": str(host), "ledger_score": round(z, 4) if math.isfinite(z) else None,
             "ledger_balance": round(balance, 4), "ledger_comparable": comparable}
        if v.get("ok") and not ok:
            centre = "median" if comparable else "median (taken no lower than 0)"
            v.update(ok=False, reason=(
                f"held-out loss check, the host's ledger: the update's loss change scores {z:.3g} above the "
                f"{centre} of trusted results' (in units of their spread), and the host's untrusted "
                f"results together stand {before + z - ledger.slack:.3g} above their allowance "
                f"(limit {ledger.limit:g})"))
        got = store.set_loss_verdict_with_ledger(rid, v, VERDICT_TTL_S, model, str(host), raw, balance,
                                                 stale_model=stale)
        if got is not None:
            return got


def decide(loss_increase: float, bound: float | None) -> dict[str, Any]:
    """The verdict on a loss increase under ``bound`` (JSON-ready)."""
    ok = rules.loss_check_passes(loss_increase, bound)
    if ok:
        why = "no trusted bound yet" if bound is None else f"loss change {loss_increase:.4g} within {bound:.4g}"
    elif not math.isfinite(loss_increase):
        why = f"the held-out loss is not finite after the update ({loss_increase})"
    else:
        why = (f"held-out loss check: the update raises the loss by {loss_increase:.4g}, above the bound "
               f"{max(0.0, bound or 0.0):.4g} (the upper tail of trusted results' increases)")
    return {"ok": ok, "loss_increase": loss_increase if math.isfinite(loss_increase) else None,
            "bound": bound, "reason": why, "t": time.time()}


def spool_dir(job_dir: str | Path) -> Path:
    return Path(job_dir) / SPOOL


def _hand_over(src: Path, job_dir: str | Path, rid: str) -> str:
    """A hard link (else a copy) of the result's weights file in the job's spool for the
    checker, which removes it once read; its name (never a path: the checker builds
    the path itself, inside the spool)."""
    d = spool_dir(job_dir)
    d.mkdir(parents=True, exist_ok=True)
    name = f"{rid}.{os.urandom(4).hex()}.h5"
    try:
        os.link(src, d / name)
    except OSError:
        shutil.copyfile(src, d / name)
    return name


def gate(store: JobStore, spec: JobSpec, *, unit: str, model: str, epoch: int, result: str,
         attempt: int | None, weights: Path, base_path: str | None, scale: float,
         trusted: bool, host: str | None = None) -> dict[str, Any] | None:
    """Run the loss check for one result before its merge (see the module doc).

    ``host``: the job system's id of the host that computed the result (its ledger;
    None: the per-result bound alone). Returns the verdict (None when nothing was
    checked: a trusted result, no trusted bound yet, or the check off), raises
    :class:`ResultRejected` for a refused result and :class:`VerdictPending` when no
    verdict came within ``validation.loss_check_wait_s``.
    """
    if not enabled(spec):
        return None
    request = {"unit": unit, "model": model, "epoch": int(epoch), "attempt": attempt, "result": result,
               "base": base_path, "scale": float(scale), "host": host}
    if trusted:
        _observe(store, request, weights)
        return None
    if bound_of(store, spec, model, epoch) is None:
        # Nothing trusted to compare with yet (no replicated results): it passes, without a
        # forward pass and without a write (a merge's Redis traffic stays what it was).
        # Trusted values are never removed, so no refusal can exist for it either; a
        # delivery that merges is never checked again (a re-delivery of a merged unit is a
        # duplicate before it gets here). Nothing to add to the merge record either.
        return None
    rid = request_id(unit, attempt, result)
    verdict = store.loss_verdict(rid)
    if verdict is None:
        verdict = _ask(store, spec, rid, request, weights)
    if not verdict.get("ok"):
        raise ResultRejected(str(verdict.get("reason") or "held-out loss check failed"), host_fault=True)
    return verdict


#: job -> (monotonic time, whether its checker's heartbeat was live): a long-lived
#: assimilator (the local backend's, whose results are all trusted and which runs no
#: checker) asks Redis once per ALIVE_CACHE_S, not once per merge.
_alive: dict[tuple[Any, ...], tuple[float, bool]] = {}
ALIVE_CACHE_S = 5.0


def _where(store: JobStore) -> tuple[Any, ...]:
    """The job and the Redis it lives in (two Redis servers may hold jobs of one name)."""
    kw = getattr(getattr(store.r, "connection_pool", None), "connection_kwargs", None)
    where = (kw.get("path"), kw.get("host"), kw.get("port"), kw.get("db")) if kw else (id(store.r),)
    return (store.job, *where)


def checker_alive(store: JobStore) -> bool:
    """Whether a checker serves ``store``'s job (its heartbeat, cached ALIVE_CACHE_S)."""
    now, key = time.monotonic(), _where(store)
    hit = _alive.get(key)
    if hit is not None and now - hit[0] < ALIVE_CACHE_S:
        return hit[1]
    alive = store.loss_checker_alive()
    _alive[key] = (now, alive)
    return alive


#: job -> the job system it runs on (it never changes): see :func:`_observe`.
_backend: dict[tuple[Any, ...], str] = {}


def _observe(store: JobStore, request: dict[str, Any], weights: Path) -> None:
    """A trusted result: its loss change feeds the statistic, measured by the checker.

    On BOINC the checker is the work generator's: a trusted result that merges while the
    daemon restarts waits in the queue for it (the check needs these measurements, and the
    work generator's spot checks count them; a lost one is replicated again). The local
    backend's results are all trusted: no result is ever judged, so none is measured (its
    run starts a checker only for ``merge_rule: search``). Elsewhere nothing waits without
    a live checker."""
    key = _where(store)
    if key not in _backend:
        _backend[key] = store.meta().get("backend", "")
    if _backend[key] == "local" or (_backend[key] != "boinc" and not checker_alive(store)):
        return
    job_dir = store.meta().get("job_dir")
    if not job_dir:
        return
    name = _hand_over(weights, job_dir, "obs")
    try:
        queued = store.post_loss_observation({**request, "kind": "observe", "file": name}, MAX_QUEUE)
    except StoreUnavailable:
        queued = False
    if not queued:
        confined(spool_dir(job_dir), name).unlink(missing_ok=True)


def _ask(store: JobStore, spec: JobSpec, rid: str, request: dict[str, Any], weights: Path) -> dict[str, Any]:
    """Queue the check of an untrusted result (unless queued already) and wait for it."""
    if not request.get("base"):
        # The unit's base weights are gone (removed by hand): the change cannot be measured
        # and the merge mixes the result instead (policy.plan_merge).
        log.warning("%s: no base weights, the loss check cannot run; passing it", request["unit"])
        verdict = {**decide(0.0, None), "loss_increase": None, "reason": "no base weights"}
        return store.set_loss_verdict(rid, verdict, VERDICT_TTL_S)[0]
    return ask(store, spec, rid, request, weights, kind="check", what="held-out loss check verdict")


def ask(store: JobStore, spec: JobSpec, rid: str, request: dict[str, Any], weights: Path, *, kind: str,
        what: str, wait_s: float | None = None) -> dict[str, Any]:
    """Hand the checker request ``rid`` of ``kind`` (a loss ``check``, a ``step`` search) with
    a copy of the result's weights file, unless it is queued already, and wait up to
    ``wait_s`` (default ``validation.loss_check_wait_s``) for its verdict (``what`` it is,
    for the message of :class:`VerdictPending`, raised when none came)."""
    job_dir = store.meta().get("job_dir")
    if not job_dir:
        raise VerdictPending(f"job {store.job!r} has no job directory for the checker's files")
    wait = spec.validation.loss_check_wait_s if wait_s is None else float(wait_s)
    deadline = time.monotonic() + wait
    name: str | None = None
    while True:
        stamp = repr(time.time())
        if name is None:
            name = _hand_over(weights, job_dir, rid)
        state, _, replaced = store.request_loss_check(rid, {**request, "kind": kind, "file": name}, stamp,
                                                      stale_s=wait, max_queue=MAX_QUEUE).partition(" ")
        if replaced and is_safe_name(replaced):
            # the copy of a request lost with a checker that died
            confined(spool_dir(job_dir), replaced).unlink(missing_ok=True)
        if state not in ("queued", "requeued"):
            # answered, queued by an earlier delivery (with its own file), or no room yet:
            # this delivery's file is not needed
            confined(spool_dir(job_dir), name).unlink(missing_ok=True)
            name = None
        if state != "full":
            break
        if time.monotonic() >= deadline:
            raise VerdictPending(f"the checker's queue is full ({MAX_QUEUE} requests); retry later")
        time.sleep(0.1)
    while True:
        verdict = store.loss_verdict(rid)
        if verdict is not None:
            return verdict
        if time.monotonic() >= deadline:
            raise VerdictPending(
                f"no {what} within {wait:g} s (the work generator runs the checker; "
                f"{store.loss_queue_length()} request(s) queued); the result is retried later")
        store.wait_loss_notice(rid, max(0.001, min(NOTICE_SLICE_S, deadline - time.monotonic())))
