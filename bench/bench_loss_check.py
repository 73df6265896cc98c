"""What the held-out loss check costs an honest project: time-to-merge and refusals.

A VC-ASGD job on digits (the setting of docs/merge-rules.md: MLP 64, Adam lr 0.002, batch 16, 2 local
epochs, 32 subsets, ``D`` units in flight) runs through the real merge path: a real
Redis, the job's real files (``prepare_job``), every unit really trained with Keras
from the base weights it was issued with, its result written as a weights file and
handed to the framework (``assimilate``, what BOINC's assimilator shim calls) as an
untrusted result, or as a trusted one (replicated: the first ``--warm`` results, then a
share ``--replicated`` of them). The checker is the work generator's
(:class:`~boinc_dl.server.work_generator.losscheck.LossChecker` with its own Keras
model), in a thread of this process as in the daemon.

Untrusted results alternate between the job's spec with the check on and the same spec
with ``validation.loss_check: false`` (the naive baseline: the merge path without it),
so both see the same model, machine load and Redis. Reported:

* time-to-merge of an untrusted result (``assimilate`` called -> returned: validation,
  the check's queue and verdict, the merge), median and p90, with and without the
  check, and their ratio; the checker's own forward passes per check;
* the share of honest untrusted results refused (every result here is honest);
* the final validation accuracy.

    flock /tmp/cpu.lock python bench/bench_loss_check.py [--epochs 6] [--D 8]

With ``--attack zeros|labelflip|alie|ipm|nudge`` it measures poisoning on the same path
instead: a share ``--attackers`` of the units come back from colluding attackers (never
replicated: the worst case) with the attacks of the simulated-order bench, crafted by
the same code (``tests/support/attacks.py``) and sized as it sizes them: at 0.99x the
clip radius in force for the unit's epoch (what the merge path computes from trusted
results), from the unit's base; many small nudges (towards a model trained on shifted
labels) at half the median honest update norm; "a little is enough" and inner-product
manipulation from the latest 32 honest updates. Every untrusted result goes through one
spec, the check on or off (``--check``); reported are the final accuracy, the attacker
results merged of those sent and the honest untrusted results refused. Run it with
``--attack none`` for the clean baseline of the same seed and ``--check``.

    flock /tmp/cpu.lock python bench/bench_loss_check.py --attack labelflip --check on
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import emit, machine  # noqa: E402
from boinc_dl.server.assimilator import losscheck as lc  # noqa: E402
from boinc_dl.server.assimilator.connection import connect  # noqa: E402
from boinc_dl.server.assimilator.framework import Delivery, assimilate  # noqa: E402
from boinc_dl.server.assimilator.policy import trusted_radius  # noqa: E402
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis  # noqa: E402
from boinc_dl.server.assimilator.store import JobStore  # noqa: E402
from boinc_dl.server.common.spec import parse_spec, spec_from_json  # noqa: E402
from boinc_dl.server.common.weights import WeightsFile, read_weights, write_weights  # noqa: E402
from boinc_dl.server.common.workunit import WEIGHTS_IN  # noqa: E402
from boinc_dl.server.work_generator.losscheck import LossChecker  # noqa: E402
from boinc_dl.server.work_generator.prepare import prepare_job  # noqa: E402
from tests.support.attacks import ATTACKS, Attack, craft  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    return float(np.quantile(np.asarray(xs), q)) if xs else float("nan")


class Job:
    """One bench job on a private Redis: its files, store, spec, the checker thread (with
    ``check``), a Keras model, the subsets, the validation split and the unit issuer."""

    def __init__(self, args: argparse.Namespace, work: Path, srv: EmbeddedRedis, name: str, check: bool):
        from boinc_dl.server.common.keras_model import configure_tf

        self.tf = configure_tf(threads=1)
        self.args = args
        spec = parse_spec({
            "name": name, "model": "models:mlp",
            "model_args": {"input_dim": 64, "hidden": 64, "n_classes": 10}, "dataset": {"name": "digits"},
            "training": {"epochs": args.epochs, "batch_size": 16, "local_epochs": 2, "learning_rate": 0.002},
            "vcasgd": {"n_subsets": args.subsets, "window": args.D},
            "validation": {"loss_check": check, "loss_ledger": getattr(args, "ledger", "on") == "on"},
            "seed": args.seed,
        })
        self.store = JobStore(connect(srv.url), spec.name)
        job_dir = work / "job"
        self.files = prepare_job(spec, self.store, job_dir, search_path=ROOT / "examples")
        self.store.set_meta(job_dir=str(job_dir))
        self.spec = spec_from_json(self.store.spec_json())
        self.fp = self.store.fingerprint("0")
        self.stop = threading.Event()
        checker = LossChecker(lambda: connect(srv.url), lambda: {spec.name: job_dir}, self.stop, idle_s=0.5)
        threading.Thread(target=checker.run, daemon=True).start()
        while check and not self.store.loss_checker_alive():  # (without the check it serves no job)
            time.sleep(0.05)
        self.model = self.tf.keras.models.load_model(self.files.model, compile=False)
        self.data = []
        for k in range(args.subsets):
            with np.load(self.files.shard(k)) as z:
                self.data.append((z["x"], z["y"]))
        with np.load(self.files.val) as z:
            self.xv, self.yv = z["x"], z["y"]
        self.rng = np.random.default_rng(args.seed)
        self.epoch_of: dict[str, int] = {}

    def issue(self, uid: int) -> tuple[str, int, str]:
        """Register unit ``uid`` (a random subset) from the current weights: (unit, subset, base file)."""
        e, k = uid // self.args.subsets + 1, int(self.rng.integers(self.args.subsets))
        flat, version = self.store.get_weights("0")
        base = self.files.weights("0", version)
        if not base.exists():
            write_weights(base, WeightsFile(flat, self.fp, job=self.spec.name, model="0", base_version=version))
        unit = f"{self.spec.name}__m0_e{e:04d}_s{uid:04d}"
        self.epoch_of[unit] = e
        # as the work generator records a unit: its base, and the window it was issued in
        # (the default rule's cap, policy.rule_for)
        self.store.register_unit(unit, {"epoch": e, "shard": k, "model": "0", "weights_version": version,
                                        "in_flight": self.args.D, "files": {WEIGHTS_IN: str(base)}}, e)
        return unit, k, str(base)

    def final_accuracy(self) -> tuple[float, int]:
        """(validation accuracy of the server weights, their version); stops the checker."""
        from boinc_dl.server.common.keras_model import set_flat

        flat, version = self.store.get_weights("0")
        set_flat(self.model, flat)
        self.model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        _, acc = self.model.evaluate(self.xv, self.yv, verbose=0)
        self.stop.set()
        return float(acc), version


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--D", type=int, default=8, help="units in flight")
    ap.add_argument("--subsets", type=int, default=32)
    ap.add_argument("--warm", type=int, default=20, help="first results replicated (trusted)")
    ap.add_argument("--replicated", type=float, default=0.2, help="share of later results replicated")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--attack", choices=("none",) + ATTACKS, default=None,
                    help="measure poisoning instead of the check's cost")
    ap.add_argument("--attackers", type=float, default=0.1, help="share of units an attacker returns")
    ap.add_argument("--check", choices=["on", "off"], default="on", help="with --attack: the loss check")
    ap.add_argument("--ledger", choices=["on", "off"], default="on", help="with --attack: the hosts' loss ledgers")
    args = ap.parse_args()
    if args.attack is not None:
        poisoning(args)
        return

    os.environ.setdefault("BDL_THREADS", "1")
    from boinc_dl.server.common.keras_model import get_flat, set_flat

    work = Path(tempfile.mkdtemp(prefix="bench-losscheck."))
    srv = EmbeddedRedis(work / "redis").start()
    try:
        job = Job(args, work, srv, "bench-losscheck", check=True)
        tf, store, spec_on, fp, model, data, issue = job.tf, job.store, job.spec, job.fp, job.model, job.data, job.issue
        spec = spec_on
        spec_off = spec_on.model_copy(update={"validation": spec_on.validation.model_copy(update={"loss_check": False})})
        rng = job.rng

        total = args.epochs * args.subsets
        inflight: deque[tuple[str, int, str]] = deque(issue(i) for i in range(min(args.D, total)))
        nxt = len(inflight)
        t_on: list[float] = []
        t_off: list[float] = []
        check_s: list[float] = []
        refused = checked = trusted_n = 0
        flip = 0
        t_start = time.perf_counter()
        while inflight:
            unit, k, base = inflight.popleft()
            set_flat(model, read_weights(base, fp).flat)
            model.compile(optimizer=tf.keras.optimizers.Adam(0.002), loss="sparse_categorical_crossentropy")
            model.fit(*data[k], epochs=2, batch_size=16, verbose=0, shuffle=True)
            out = work / "results" / unit
            out.mkdir(parents=True)
            write_weights(out / "weights_out.h5", WeightsFile(get_flat(model).astype(np.float32), fp, job=spec.name,
                                                              model="0", unit=unit, examples_seen=len(data[k][0])))
            done = len(t_on) + len(t_off) + trusted_n
            trusted = done < args.warm or rng.random() < args.replicated
            if not trusted and trusted_n == args.warm:
                # the checker measures the warm-up's trusted results asynchronously: every
                # untrusted result timed "with the check" is really checked
                need = spec_on.validation.loss_check_min_trusted
                while len(store.trusted_values("0", lc.STAT, 64)) < need:
                    time.sleep(0.01)
            if trusted:
                use = spec_on
            else:
                use = spec_on if flip % 2 == 0 else spec_off
                flip += 1
            t0 = time.perf_counter()
            res = assimilate(store, Delivery(unit, f"{unit}_0", unit=unit, files=[out / "weights_out.h5"],
                                             final=True, trusted=trusted), spec=use)
            dt = time.perf_counter() - t0
            if trusted:
                trusted_n += 1
            elif use is spec_on:
                t_on.append(dt)
                checked += 1
                if res.status == "rejected":
                    refused += 1
                rec = store.assimilated().get(unit) or {}
                if res.status == "merged":
                    assert rec.get("loss_check_s") is not None, "an untrusted result merged unchecked"
                    check_s.append(float(rec["loss_check_s"]))
            else:
                t_off.append(dt)
            if nxt < total:
                inflight.append(issue(nxt))
                nxt += 1
        wall = time.perf_counter() - t_start
        acc, version = job.final_accuracy()
        bound_n = len(store.trusted_values("0", lc.STAT, 64))
        med_on, med_off = statistics.median(t_on), statistics.median(t_off)
        row = {
            "dataset": "digits", "D": args.D, "subsets": args.subsets, "epochs": args.epochs,
            "results": total, "trusted": trusted_n, "untrusted_checked": checked, "untrusted_unchecked": len(t_off),
            "honest_refused": refused, "honest_refused_pct": round(100.0 * refused / max(1, checked), 2),
            "ttm_check_median_ms": round(1e3 * med_on, 2), "ttm_check_p90_ms": round(1e3 * pct(t_on, 0.9), 2),
            "ttm_nocheck_median_ms": round(1e3 * med_off, 2), "ttm_nocheck_p90_ms": round(1e3 * pct(t_off, 0.9), 2),
            "ttm_ratio_median": round(med_on / med_off, 3),
            "checker_forward_median_ms": round(1e3 * statistics.median(check_s), 2) if check_s else None,
            "trusted_loss_samples": bound_n, "final_val_acc": round(float(acc), 4), "version": version,
            "wall_s": round(wall, 1), "load": [round(x, 2) for x in os.getloadavg()], **machine(),
        }
        print(f"digits, D={args.D}, {total} honest results ({trusted_n} trusted): "
              f"time-to-merge of an untrusted result {row['ttm_check_median_ms']} ms with the check vs "
              f"{row['ttm_nocheck_median_ms']} ms without (x{row['ttm_ratio_median']}; p90 "
              f"{row['ttm_check_p90_ms']} vs {row['ttm_nocheck_p90_ms']} ms); checker forward passes "
              f"{row['checker_forward_median_ms']} ms; honest refused {refused}/{checked} "
              f"({row['honest_refused_pct']}%); final accuracy {row['final_val_acc']}")
        emit("loss_check", **row)
    finally:
        srv.kill()


def poisoning(args: argparse.Namespace) -> None:
    """Final accuracy under a share of attacker results, through the real merge path."""
    os.environ.setdefault("BDL_THREADS", "1")
    from boinc_dl.server.common.keras_model import get_flat, set_flat

    work = Path(tempfile.mkdtemp(prefix="bench-poison."))
    srv = EmbeddedRedis(work / "redis").start()
    try:
        job = Job(args, work, srv, "bench-poison", check=args.check == "on")
        tf, store, spec, fp, model, data, issue = job.tf, job.store, job.spec, job.fp, job.model, job.data, job.issue
        rng = job.rng
        arng = np.random.default_rng(args.seed + 1000)  # the attack's draws: the same honest units either way

        attack = None if args.attack == "none" else Attack(args.attack, frac=args.attackers)
        target = None
        if attack is not None and attack.kind == "nudge":
            # the nudges' target: a model trained on shifted labels from the initial weights
            x_all = np.concatenate([x for x, _ in data])
            y_all = np.concatenate([y for _, y in data])
            set_flat(model, store.get_weights("0")[0])
            model.compile(optimizer=tf.keras.optimizers.Adam(0.002), loss="sparse_categorical_crossentropy")
            model.fit(x_all, (y_all + 1) % 10, epochs=2, batch_size=16, verbose=0, shuffle=True)
            target = get_flat(model).astype(np.float32)
        honest_updates: deque[np.ndarray] = deque(maxlen=32)  # what colluders see of honest work
        honest_norms: deque[float] = deque(maxlen=64)

        total = args.epochs * args.subsets
        inflight: deque[tuple[str, int, str]] = deque(issue(i) for i in range(min(args.D, total)))
        nxt = len(inflight)
        done = sent = merged_bad = honest_refused = honest_untrusted = bad_ledger = honest_ledger = 0
        radii: list[float] = []
        while inflight:
            unit, k, base = inflight.popleft()
            bad = attack is not None and done >= args.warm and arng.random() < args.attackers
            wb = read_weights(base, fp).flat
            trained = None
            if not bad or attack.trains:  # type: ignore[union-attr]
                x, y = data[k]
                if bad:  # labelflip: a model trained on shifted labels
                    y = (y + 1) % 10
                set_flat(model, wb)
                model.compile(optimizer=tf.keras.optimizers.Adam(0.002), loss="sparse_categorical_crossentropy")
                model.fit(x, y, epochs=2, batch_size=16, verbose=0, shuffle=True)
                trained = get_flat(model).astype(np.float32)
            if bad:
                # sized against the clip radius the merge path has in force for the unit's epoch
                radius = trusted_radius(store, spec, "0", job.epoch_of[unit])
                if radius is not None:
                    radii.append(radius)
                flat = craft(attack, wb, radius, honest_updates=honest_updates,  # type: ignore[arg-type]
                             honest_norms=honest_norms, trained=trained, target=target)
            else:
                flat = trained  # type: ignore[assignment]
                honest_updates.append(flat - wb)
                honest_norms.append(float(np.linalg.norm(flat - wb)))
            out = work / "results" / unit
            out.mkdir(parents=True)
            write_weights(out / "weights_out.h5", WeightsFile(flat, fp, job=spec.name, model="0", unit=unit,
                                                              examples_seen=len(data[k][0])))
            trusted = not bad and (done < args.warm or rng.random() < args.replicated)
            if not trusted and done >= args.warm:
                while len(store.trusted_values("0", lc.STAT, 64)) < spec.validation.loss_check_min_trusted \
                        and args.check == "on":
                    time.sleep(0.01)
            # BOINC's host ids: honest units from 36 hosts, the colluders' from 4 of their own
            host = f"{9000 + done % 4}" if bad else f"{100 + done % 36}"
            res = assimilate(store, Delivery(unit, f"{unit}_0", unit=unit, files=[out / "weights_out.h5"],
                                             final=True, trusted=trusted, host=host), spec=spec)
            by_ledger = res.status == "rejected" and "the host's ledger" in (res.reason or "")
            done += 1
            if bad:
                sent += 1
                merged_bad += res.status == "merged"
                bad_ledger += by_ledger
            elif not trusted:
                honest_untrusted += 1
                honest_refused += res.status == "rejected"
                honest_ledger += by_ledger
            if nxt < total:
                inflight.append(issue(nxt))
                nxt += 1
        acc, _version = job.final_accuracy()
        row = {"dataset": "digits", "attack": args.attack, "attackers": args.attackers, "check": args.check,
               "D": args.D, "subsets": args.subsets, "epochs": args.epochs, "results": total,
               "attacker_sent": sent, "attacker_merged": merged_bad, "honest_untrusted": honest_untrusted,
               "honest_refused": honest_refused, "final_val_acc": round(float(acc), 4), "seed": args.seed,
               "ledger": args.ledger, "attacker_refused_by_ledger": bad_ledger, "honest_refused_by_ledger": honest_ledger,
               "clip_radius_median": round(statistics.median(radii), 4) if radii else None,
               "honest_norm_median": round(statistics.median(honest_norms), 4) if honest_norms else None,
               "load": [round(x, 2) for x in os.getloadavg()], **machine()}
        print(f"digits, {args.attack} from {args.attackers:.0%} of units, check {args.check}: attacker results "
              f"merged {merged_bad}/{sent} ({bad_ledger} refused by the ledger), honest refused "
              f"{honest_refused}/{honest_untrusted} ({honest_ledger} by the ledger), "
              f"final accuracy {row['final_val_acc']}")
        emit("loss_check_poisoning", **row)
    finally:
        srv.kill()


if __name__ == "__main__":
    main()
