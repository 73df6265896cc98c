"""BOINC client calls: report a unit lost through ``boinccmd`` and find the running task
from its slot directory."""

from __future__ import annotations

import contextlib
import html
import logging
import os
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

def _boinccmd_prefix(boinccmd: str, host: str | None, passwd: str | None) -> list[str]:
    argv = [boinccmd]
    if host:
        argv += ["--host", host]
    if passwd:
        argv += ["--passwd", passwd]
    return argv


def _require(value: str, what: str) -> str:
    if not isinstance(value, str) or not value.strip() or value != value.strip():
        raise ValueError(f"{what} must be a non-empty string without surrounding blanks: {value!r}")
    return value


def boinccmd_abort_argv(
    project_url: str,
    task_name: str,
    boinccmd: str = "boinccmd",
    *,
    host: str | None = None,
    passwd: str | None = None,
) -> list[str]:
    """``boinccmd [--host H] [--passwd P] --task <project_url> <task_name> abort``.

    ``--host``/``--passwd`` must precede the command (boinccmd parses them first).
    """
    return _boinccmd_prefix(boinccmd, host, passwd) + [
        "--task",
        _require(project_url, "project URL"),
        _require(task_name, "task name"),
        "abort",
    ]


def boinccmd_update_argv(
    project_url: str,
    boinccmd: str = "boinccmd",
    *,
    host: str | None = None,
    passwd: str | None = None,
) -> list[str]:
    """``boinccmd [--host H] [--passwd P] --project <project_url> update``: contact the
    project's scheduler now, reporting finished (and aborted) tasks."""
    return _boinccmd_prefix(boinccmd, host, passwd) + [
        "--project",
        _require(project_url, "project URL"),
        "update",
    ]


def _redacted(argv: Iterable[str]) -> str:
    out, hide = [], False
    for arg in argv:
        out.append("***" if hide else arg)
        hide = arg == "--passwd"
    return " ".join(out)


def _run_boinccmd(argv: list[str], cwd: str | None, timeout: float) -> str | None:
    """Run one boinccmd; None on success, else a one-line error."""
    if cwd is not None and not Path(cwd).is_dir():
        return f"BOINC data directory {cwd} does not exist"
    try:
        done = subprocess.run(
            argv,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except FileNotFoundError:
        return f"{argv[0]} not found"
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout:g}s"
    except OSError as exc:
        return str(exc)
    if done.returncode != 0:
        detail = (done.stderr or done.stdout or "").strip().replace("\n", " | ")
        return f"exit status {done.returncode}: {detail[-400:]}"
    return None


def report_lost_to_boinc(
    project_url: str,
    task_name: str,
    boinccmd: str = "boinccmd",
    *,
    host: str | None = None,
    passwd: str | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    report_now: bool = True,
    timeout: float = 15.0,
) -> bool:
    """Abort ``task_name`` in the local BOINC client so that the server re-issues it now.

    Runs ``boinccmd --task <project_url> <task_name> abort`` and then, if ``report_now``,
    ``boinccmd --project <project_url> update``: an aborted task is only reported at the
    client's next scheduler RPC, and ``update`` makes that happen at once, before the VM is
    gone. The order matters: the client processes GUI RPCs, then marks aborted tasks ready to
    report, then starts scheduler RPCs, so an ``update`` sent first could go out without the
    aborted task. When the server receives the aborted result it marks the workunit for the
    transitioner at once, which creates a new instance of the unit.

    Call it last, after the checkpoint is written: the BOINC client then asks the running
    app to quit (and ignores its exit status), so this process may be killed soon after the
    abort. Only the re-issue is lost; the server's copy of the unit's inputs is unchanged.

    Server-side accounting of an abort (exit status 203, ``EXIT_ABORTED_VIA_GUI``): servers
    since 2014 count it as "no reply", not as an error against ``max_error_results``; older
    servers count it as an error. It always counts against ``max_total_results``, and the
    scheduler lowers the host's daily job quota by one. So the work generator must pass
    ``max_total_results`` >= 2 (one more than retries wanted) and ``max_error_results`` >= 2.

    boinccmd reads the GUI RPC password from ``gui_rpc_auth.cfg`` in its working directory,
    so pass the BOINC data directory as ``data_dir`` (from ``init_data.xml``'s
    ``boinc_dir``, see :func:`boinc_task_from_slot`) rather than ``passwd`` (visible in
    ``ps``). Errors (boinccmd missing, refused, timed out, non-zero exit) are logged and
    reported by returning False, never raised. True means the abort was accepted; a failed
    ``update`` is only logged (the abort is reported with the client's next RPC).
    """
    try:
        abort = boinccmd_abort_argv(project_url, task_name, boinccmd, host=host, passwd=passwd)
        update = boinccmd_update_argv(project_url, boinccmd, host=host, passwd=passwd)
    except ValueError as exc:
        log.error("cannot report task lost to BOINC: %s", exc)
        return False
    cwd = os.fspath(data_dir) if data_dir is not None else None
    error = _run_boinccmd(abort, cwd, timeout)
    if error:
        log.error("BOINC abort failed (%s): %s", _redacted(abort), error)
        return False
    log.warning("aborted BOINC task %s so that %s re-issues it", task_name, project_url)
    if report_now:
        error = _run_boinccmd(update, cwd, timeout)
        if error:
            log.warning("BOINC project update failed (%s): %s", _redacted(update), error)
    return True


@dataclass(frozen=True)
class BoincTask:
    """The running BOINC task, as needed by :func:`report_lost_to_boinc`."""

    project_url: str
    task_name: str
    data_dir: str


def escape_project_url(url: str) -> str:
    """The BOINC client's directory name for a project URL (``projects/<name>``,
    ``account_<name>.xml``): scheme dropped, characters other than letters, digits, ``.``,
    ``-`` and ``_`` replaced by ``_``, one trailing ``_`` removed."""
    rest = url.split("://", 1)[1] if "://" in url else url
    out = "".join(c if (c.isascii() and c.isalnum()) or c in ".-_" else "_" for c in rest)
    return out[:-1] if out.endswith("_") else out


def _xml_field(text: str, tag: str) -> str | None:
    match = re.search(rf"<{tag}>\s*(.*?)\s*</{tag}>", text, re.S)
    return html.unescape(match.group(1)) if match else None


def boinc_task_from_slot(slot_dir: str | os.PathLike[str] = ".") -> BoincTask | None:
    """Read the task's identity from the slot's ``init_data.xml`` (None if not under BOINC).

    ``init_data.xml`` gives ``result_name`` (the task name), ``boinc_dir`` (the data
    directory) and ``project_dir`` (``<boinc_dir>/projects/<escaped URL>``); the master URL
    itself is read from the matching ``account_<escaped URL>.xml`` in the data directory,
    or else from ``client_state.xml``.
    """
    try:
        init = (Path(slot_dir) / "init_data.xml").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    task_name = _xml_field(init, "result_name")
    data_dir = _xml_field(init, "boinc_dir")
    project_dir = _xml_field(init, "project_dir")
    if not (task_name and data_dir and project_dir):
        return None
    escaped = Path(project_dir.rstrip("/\\")).name
    url = None
    account = Path(data_dir) / f"account_{escaped}.xml"
    with contextlib.suppress(OSError):
        url = _xml_field(account.read_text(encoding="utf-8", errors="replace"), "master_url")
    if not url:
        with contextlib.suppress(OSError):
            state = (Path(data_dir) / "client_state.xml").read_text(
                encoding="utf-8", errors="replace"
            )
            for candidate in re.findall(r"<master_url>\s*(.*?)\s*</master_url>", state, re.S):
                if escape_project_url(html.unescape(candidate)) == escaped:
                    url = html.unescape(candidate)
                    break
    if not url:
        return None
    return BoincTask(project_url=url, task_name=task_name, data_dir=data_dir)
