"""Run one of BOINC's command-line tools in the BOINC container, from boinc-dl's (docker stack).

Usage: ``python -m boinc_dl.server.backends.boinc.toolcall TOOL [ARGS...]`` (stdin is
passed on); the boinc-dl image installs it as ``bdl-boinc-call`` and as one small
script per tool under ``/opt/boinc-dl/boinc-bin`` (``create_work ARGS...``). The call is written as a request
directory into ``$BDL_SPOOL/calls/`` (built in ``tmp/`` and renamed in), the BOINC
container's ``bdl_call_runner.sh`` runs ``$PROJECT_ROOT/bin/TOOL ARGS`` there, and
this program prints the tool's stdout and stderr and exits with its status, as if
the tool had run here. So a work generator that runs ``bin/create_work`` can be
pointed at this program instead and needs no other change.

Exit status 75 (EX_TEMPFAIL) when the runner did not answer within
``$BDL_CALL_TIMEOUT`` seconds (default 600): the request is withdrawn if it was not
started yet. File arguments must be on a volume mounted at the same path in both
containers (the project volume or the spool).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_SPOOL = "/var/lib/boinc-dl/spool"
EX_TEMPFAIL = 75
TOOLS_READING_STDIN = ("update_versions",)  # it asks for confirmation


class CallError(Exception):
    """The call could not be handed over or answered."""


def call(
    tool: str,
    args: list[str],
    stdin: bytes | None = None,
    spool: str | Path | None = None,
    timeout: float | None = None,
    poll: float = 0.1,
) -> tuple[int, bytes, bytes]:
    """Run ``tool args`` through the runner; returns (exit status, stdout, stderr)."""
    spool = Path(spool or os.environ.get("BDL_SPOOL", DEFAULT_SPOOL))
    timeout = float(os.environ.get("BDL_CALL_TIMEOUT", "600")) if timeout is None else timeout
    if not tool or "/" in tool or "\n" in tool:
        raise CallError(f"bad tool name {tool!r}")
    for a in args:
        if "\n" in a:
            raise CallError(f"argument {a!r} contains a newline")
    for d in ("tmp", "calls", "calls-done"):
        (spool / d).mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    work = Path(tempfile.mkdtemp(prefix=f"{stamp}-", dir=spool / "tmp"))
    try:
        (work / "tool").write_text(tool + "\n")
        (work / "args").write_text("".join(a + "\n" for a in args))
        if stdin is not None:
            (work / "stdin").write_bytes(stdin)
        for f in work.iterdir():
            _fsync(f)
        work.chmod(0o775)
        os.rename(work, spool / "calls" / work.name)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    name = work.name
    done = spool / "calls-done" / name
    deadline = time.monotonic() + timeout
    while not (done / "rc").exists():
        if time.monotonic() > deadline:
            try:  # not started yet: take it back so it never runs late
                os.rename(spool / "calls" / name, spool / "tmp" / f"{name}.withdrawn")
                shutil.rmtree(spool / "tmp" / f"{name}.withdrawn", ignore_errors=True)
                state = "withdrawn"
            except FileNotFoundError:
                state = "still running in the BOINC container"
            raise CallError(f"no answer from the BOINC call runner within {timeout:.0f}s ({tool}: {state})")
        time.sleep(poll)
    try:
        rc = int((done / "rc").read_text().strip() or "1")
        out = (done / "stdout").read_bytes() if (done / "stdout").exists() else b""
        err = (done / "stderr").read_bytes() if (done / "stderr").exists() else b""
    finally:
        shutil.rmtree(done, ignore_errors=True)
    return rc, out, err


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    """``TOOL ARGS...``: run the tool through the call runner and exit with its status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    tool, args = argv[0], argv[1:]
    # Only the tools that read stdin get it (reading an idle inherited pipe would hang).
    wants_stdin = "--stdin" in args or tool in TOOLS_READING_STDIN
    stdin = sys.stdin.buffer.read() if wants_stdin and sys.stdin is not None and not sys.stdin.isatty() else None
    try:
        rc, out, err = call(tool, args, stdin)
    except CallError as e:
        print(f"bdl-boinc-call: {e}", file=sys.stderr)
        return EX_TEMPFAIL
    sys.stdout.buffer.write(out)
    sys.stdout.flush()
    sys.stderr.buffer.write(err)
    sys.stderr.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
