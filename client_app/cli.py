"""``python -m boinc_dl.client_app``: train the workunit of a BOINC slot directory.

Exit codes:

* 0  -- outputs written (``weights_out.h5``, ``metrics.json``);
* 1  -- permanent error: bad ``wu.json``, missing or unreadable inputs, weights that
  do not match the model (one line on stderr); retrying on this host cannot help;
* 2  -- usage error (bad arguments, no such slot directory);
* 75 -- interrupted (SIGTERM/SIGINT or a spot-interruption notice): a checkpoint is
  written and a restart in the same slot resumes from it (``EX_TEMPFAIL``). After a
  spot notice under a BOINC client, the task is also aborted through ``boinccmd`` so
  that the server re-issues it at once rather than at its deadline (in a BOINC Docker
  app's container the exit status itself fails the task, with the same effect).

An unexpected internal error also exits 1, with its traceback (it is a bug to report).

Kept light on purpose: argparse, and TensorFlow imported only after the GPU has been
chosen (``CUDA_VISIBLE_DEVICES`` must be set before TensorFlow starts).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from boinc_dl.client_app.boinc_io import InitData, read_init_data
from boinc_dl.client_app.lifeline import tie_to_parent

EXIT_OK = 0
EXIT_INPUT = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 75
PREEMPTION_REASON = "preemption notice"
#: Set by the entry point of the BOINC Docker app's container (docker_main.sh).
CONTAINER_ENV = "BDL_CONTAINER"

log = logging.getLogger("boinc_dl.client_app")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(
        prog="python -m boinc_dl.client_app",
        description="Train one boinc-dl workunit from the input files of a (BOINC slot) directory.",
    )
    p.add_argument("--slot", default=".", help="slot directory holding the unit's files (default: current directory)")
    p.add_argument("--device", type=int, default=None,
                   help="GPU number to use; a negative number means CPU only (default: init_data.xml, else TensorFlow's choice)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="TensorFlow threads (default: init_data.xml's ncpus, else $BDL_THREADS, else TensorFlow's choice)")
    p.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    return p


def select_device(device: int | None, init: InitData | None, env: MutableMapping[str, str] | None = None) -> str:
    """Make the chosen GPU the only one TensorFlow sees; call before importing TensorFlow.

    ``device`` (the command line) wins, then the GPU the BOINC client assigned in
    ``init_data.xml``. A task the client scheduled as a CPU task hides the GPUs, since
    they may be assigned to other tasks. With neither, TensorFlow picks. Returns a
    short description for the log.
    """
    env = os.environ if env is None else env
    gpu_type = init.gpu_type.lower() if init is not None else ""
    if device is None and init is not None and init.uses_gpu:
        device = init.gpu_device_num
    var = "HIP_VISIBLE_DEVICES" if gpu_type in ("ati", "amd") else "CUDA_VISIBLE_DEVICES"
    if device is not None and device < 0:
        env[var] = ""
        return "CPU (GPUs hidden)"
    if device is not None:
        env[var] = str(device)
        # Do not reserve all GPU memory up front: the host may run other tasks on it.
        env.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
        return f"GPU {device} ({var}={device})"
    if init is not None:
        env[var] = ""
        return "CPU (BOINC CPU task: GPUs hidden)"
    return "TensorFlow's choice"


def choose_threads(arg: int | None, init: InitData | None, env: MutableMapping[str, str] | None = None) -> int | None:
    """TensorFlow threads: the argument, else init_data's ncpus, else $BDL_THREADS, else None."""
    env = os.environ if env is None else env
    if arg:
        return arg
    if init is not None and init.ncpus > 0:
        return max(1, round(init.ncpus))
    raw = env.get("BDL_THREADS", "").strip()
    if raw:
        try:
            v = int(raw)
            if v > 0:
                return v
        except ValueError:
            pass
        log.warning("ignoring BDL_THREADS=%r: not a positive integer", raw)
    return None


class StopFlag:
    """Set once by a signal or a preemption notice; polled by the training loop."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()
            log.warning("%s: checkpointing and stopping", reason)


def install_signal_handlers(flag: StopFlag) -> None:
    """SIGTERM/SIGINT: first one asks for a checkpoint and exit 75; a second one kills at once."""

    def handler(signum: int, frame: Any) -> None:
        if flag.is_set():
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        flag.set(f"signal {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def start_preemption_watcher(flag: StopFlag) -> object | None:
    """Start the cloud spot-interruption watcher if that module is installed."""
    try:
        from boinc_dl.client_app.preemption import start_watcher
    except ImportError:
        return None
    try:
        return start_watcher(lambda notice: flag.set(f"{PREEMPTION_REASON} ({notice})"))
    except Exception as e:  # noqa: BLE001 - training goes on without early notices
        log.warning("preemption watcher not started: %s: %s", type(e).__name__, e)
        return None


def _stop_watcher(watcher: object | None) -> None:
    stop = getattr(watcher, "stop", None)
    if callable(stop):
        try:
            stop()
        except Exception as e:  # noqa: BLE001 - the unit's outcome is already decided
            log.warning("stopping the preemption watcher failed: %s", e)


def report_lost_if_boinc(slot: Path) -> bool:
    """After a preemption notice, abort the BOINC task so the server re-issues it at once.

    Runs only under a BOINC client (the slot's ``init_data.xml`` names the task) and
    after the checkpoint is written: the abort makes the client stop this task.

    Not in a BOINC Docker app's container (``$BDL_CONTAINER``, set by its entry point):
    the client's GUI RPC and ``boinccmd`` are out of its reach there. Exit 75 does the
    same job: docker_wrapper passes the container's status to the client, which
    reports the task as failed at its next scheduler request, and the server creates a
    new instance of the unit then (it counts as an error against ``max_error_results``,
    where an abort counts as no reply).
    """
    if os.environ.get(CONTAINER_ENV, "").strip():
        return False
    try:
        from boinc_dl.client_app.preemption import boinc_task_from_slot, report_lost_to_boinc
    except ImportError:
        return False
    try:
        task = boinc_task_from_slot(slot)
        if task is None:
            return False
        return bool(report_lost_to_boinc(task.project_url, task.task_name, data_dir=task.data_dir))
    except Exception as e:  # noqa: BLE001 - the deadline re-issues the unit anyway
        log.warning("could not report the task lost to BOINC: %s: %s", type(e).__name__, e)
        return False


def main(argv: list[str] | None = None) -> int:
    """Run one unit; returns the process exit code (see the module docstring)."""
    return run_cli(argv)[0]


def run_cli(argv: list[str] | None = None) -> tuple[int, bool]:
    """Run one unit; returns the exit code and whether a preemption notice stopped it."""
    args = build_parser().parse_args(argv)  # exits 2 on a usage error
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s client_app: %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    tie_to_parent()
    slot = Path(args.slot)
    if not slot.is_dir():
        print(f"client_app: error: slot directory not found: {slot}", file=sys.stderr)
        return EXIT_USAGE, False
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    init = read_init_data(slot)
    device = select_device(args.device, init)
    threads = choose_threads(args.threads, init)
    log.info("slot %s, device: %s, threads: %s", slot.resolve(), device, threads or "default")

    flag = StopFlag()
    install_signal_handlers(flag)
    watcher = start_preemption_watcher(flag)
    try:
        from boinc_dl.client_app.train import run_unit
        from boinc_dl.server.common.errors import BoincDLError

        try:
            result = run_unit(slot, threads=threads, should_stop=flag.is_set)
        except BoincDLError as e:
            print(f"client_app: error: {e}", file=sys.stderr)
            return EXIT_INPUT, False
        except Exception as e:  # noqa: BLE001 - not an input problem: keep the trace for the logs
            traceback.print_exc(file=sys.stderr)
            print(f"client_app: error: unexpected {type(e).__name__}: {e}", file=sys.stderr)
            return EXIT_INPUT, False
    finally:
        _stop_watcher(watcher)
    if not result.interrupted:
        return EXIT_OK, False
    preempted = flag.reason.startswith(PREEMPTION_REASON)
    if preempted:
        report_lost_if_boinc(slot)
    return EXIT_INTERRUPTED, preempted
