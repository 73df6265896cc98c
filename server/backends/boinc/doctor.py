"""``boinc-dl boinc doctor``: the setup gaps a BOINC project admin hits, each with its fix.

Every check here was hit on a real server installed as ``docs/boinc.md`` describes
(release 1.6.2 built from source, ``make_project``, Debian's Apache and PHP). Install
runs the same checks and prints what fails; ``doctor`` prints every check and exits 1
when one fails.

* ``bin/xadd`` and ``bin/update_versions`` are PHP scripts (``#!/usr/bin/env php``):
  ``simplexml_load_file`` needs PHP's XML extension (Debian: ``php-xml``), the database
  needs ``mysqli`` (``php-mysql``).
* BOINC's PHP refuses to connect without a database password (``BoincDb::get_aux``,
  ``html/inc/boinc_db.inc``: ``if (!$name || !$user || !$passwd)``); ``make_project``
  writes a blank ``<db_passwd>`` when given none.
* ``bin/start`` is ``#!/usr/bin/env python``: the ``python`` that the admin's shell and
  cron find must run its imports (the project's ``bin/boinc_path_config.py``, BOINC's
  ``py/Boinc`` modules; no database driver, on releases 1.2 to master; Debian:
  ``python-is-python3``).
* ``bin/start`` starts only the daemons whose host is this machine's short host name
  (``sched/start``: ``task.host = config.host``, compared with ``gethostname()``);
  ``make_project`` may write ``<host>localhost</host>``, and then nothing starts.
* The web server's user runs the scheduler CGI, the upload handler and the admin page:
  it writes ``log_<host>/`` and ``upload/``, and reads ``boinc-dl.yaml`` (0640, the
  project's group).
* The admin page lives in ``html/ops/``, which ``make_project``'s ``.htaccess`` protects
  with ``html/ops/.htpasswd``: without that file the page answers 500.
* ``html/project/project.inc`` keeps ``REPLACE WITH PROJECT NAME`` until edited: every
  page title shows it.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from boinc_dl.server.backends.boinc.project import ENV_TOOL_RUNNER, BoincProject

#: Debian's, Red Hat's and a plain Apache's user of the web server.
WEB_USERS = ("www-data", "apache", "httpd", "daemon")
#: The PATH cron gives a job (``bin/start --cron`` runs from cron).
CRON_PATH = "/usr/bin:/bin"
PLACEHOLDER_NAME = "REPLACE WITH PROJECT NAME"


@dataclass
class Finding:
    """One check: passed or not, what was seen, and how to fix it."""

    name: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self) -> str:
        mark = "ok  " if self.ok else "FIX "
        return f"{mark} {self.name}: {self.detail}" + ("" if self.ok or not self.fix else f"\n       fix: {self.fix}")


def _run(cmd: list[str], path: str | None = None) -> tuple[int, str]:
    env = dict(os.environ)
    if path is not None:
        env["PATH"] = path
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
    except (OSError, subprocess.SubprocessError) as e:
        return 127, str(e)
    return p.returncode, (p.stdout + p.stderr).strip()


def check_php() -> Finding:
    """PHP with the XML and MySQL extensions, for bin/xadd and bin/update_versions."""
    php = shutil.which("php")
    if not php:
        return Finding("php for bin/xadd", False, "no php on PATH",
                       "install PHP's command line with its XML and MySQL extensions "
                       "(Debian: apt-get install php-cli php-xml php-mysql)")
    code, out = _run([php, "-r", 'echo (function_exists("simplexml_load_file") ? "xml " : "")'
                                  '. (class_exists("mysqli") ? "mysqli" : "");'])
    have = set(out.split()) if code == 0 else set()
    missing = [m for m, pkg in (("xml", "php-xml"), ("mysqli", "php-mysql")) if m not in have]
    if missing:
        pkgs = " ".join({"xml": "php-xml", "mysqli": "php-mysql"}[m] for m in missing)
        return Finding("php for bin/xadd", False, f"{php} lacks {', '.join(missing)}",
                       f"apt-get install {pkgs} (bin/xadd reads project.xml with simplexml)")
    return Finding("php for bin/xadd", True, f"{php} has xml and mysqli")


def check_db_password(project: BoincProject) -> Finding:
    pw = project.config.get("db_passwd")
    if pw is None or not pw.strip():
        return Finding("database password", False, "<db_passwd> in config.xml is empty",
                       "give the database user a password and put it in <db_passwd> "
                       "(BOINC's PHP refuses to connect without one: html/inc/boinc_db.inc)")
    return Finding("database password", True, "set")


#: What ``bin/start`` imports before it starts a daemon (``sched/start``, releases 1.2 to
#: 1.6 and master): the project's ``bin/boinc_path_config.py`` (written by make_project)
#: and BOINC's own Python modules under ``py/``; no database driver.
START_IMPORTS = "import boinc_path_config; from Boinc import boinc_project_path, configxml"


def check_python_for_start(project: BoincProject | None = None, path: str | None = None) -> Finding:
    """The ``python`` of bin/start's ``#!/usr/bin/env python``, in the admin's PATH and
    cron's: it must run bin/start's own imports (:data:`START_IMPORTS`, from the project's
    ``bin/``); a project without ``bin/boinc_path_config.py`` (not made by make_project)
    only needs a python that runs."""
    problems = []
    bin_dir = project.bin_dir if project is not None else None
    own = bin_dir is not None and (bin_dir / "boinc_path_config.py").is_file()
    code_line = f"import sys; sys.path.insert(0, {str(bin_dir)!r}); {START_IMPORTS}" if own else "import sys"
    for where, p in (("your PATH", path if path is not None else os.environ.get("PATH", "")), ("cron's PATH", CRON_PATH)):
        py = shutil.which("python", path=p)
        if not py:
            problems.append(f"no python in {where}")
            continue
        code, out = _run([py, "-c", code_line], p)
        if code != 0:
            last = out.strip().splitlines()[-1] if out.strip() else f"exit {code}"
            problems.append(f"{py} ({where}) cannot run bin/start's imports: {last}")
    if problems:
        return Finding("python for bin/start", False, "; ".join(problems),
                       "bin/start runs '/usr/bin/env python': apt-get install python-is-python3 "
                       "(or put a python that runs it first on PATH, cron's PATH=/usr/bin:/bin included)")
    return Finding("python for bin/start", True, "python runs bin/start's imports (also in cron's PATH)")


def check_host(project: BoincProject) -> Finding:
    host = (project.config.get("host") or "").strip()
    here = socket.gethostname().split(".")[0]
    if host != here:
        return Finding("daemon host", False, f"config.xml <host> is {host or '(none)'!r}, this machine is {here!r}",
                       f"set <host>{here}</host> in config.xml: bin/start starts only the daemons of "
                       "the host named there (and then uses log_<host>, pid_<host>, tmp_<host>)")
    return Finding("daemon host", True, f"<host> is {here}")


def web_user(name: str | None = None) -> pwd.struct_passwd | None:
    """The web server's user: ``name``, else Apache's ``APACHE_RUN_USER``, else the first
    of :data:`WEB_USERS` that exists."""
    names = [name] if name else []
    envvars = Path("/etc/apache2/envvars")
    if not name and envvars.is_file():
        for line in envvars.read_text(errors="replace").splitlines():
            if "APACHE_RUN_USER=" in line:
                names.append(line.split("=", 1)[1].strip().strip("'\""))
    names += [] if name else list(WEB_USERS)
    for n in names:
        try:
            return pwd.getpwnam(n)
        except KeyError:
            continue
    return None


def user_can(user: pwd.struct_passwd, path: Path, write: bool) -> bool:
    """Whether ``user`` may read (or write) ``path`` by its mode bits (root may do all)."""
    if user.pw_uid == 0:
        return True
    try:
        st = path.stat()
    except OSError:
        return False
    groups = {user.pw_gid} | {g.gr_gid for g in grp.getgrall() if user.pw_name in g.gr_mem}
    need = 0o2 if write else 0o4
    if path.is_dir():
        need |= 0o1
    if st.st_uid == user.pw_uid:
        bits = (st.st_mode >> 6) & 0o7
    elif st.st_gid in groups:
        bits = (st.st_mode >> 3) & 0o7
    else:
        bits = st.st_mode & 0o7
    return bits & need == need


def check_web_access(project: BoincProject, user_name: str | None = None) -> Finding:
    user = web_user(user_name)
    if user is None:
        return Finding("web server access", True, "no web server user found here (checked only where Apache runs)")
    wants = [(project.log_dir, True), (project.upload_dir, True)]
    if project.settings_file.exists():
        wants.append((project.settings_file, False))
    bad = [f"{p} ({'write' if w else 'read'})" for p, w in wants if not user_can(user, p, w)]
    if bad:
        return Finding("web server access", False, f"{user.pw_name} cannot use {', '.join(bad)}",
                       f"put {user.pw_name} in the project's group and give the group access: "
                       f"chgrp -R <group> {project.root}; chmod g+rws {project.log_dir} {project.upload_dir}; "
                       f"chmod g+r {project.settings_file}")
    return Finding("web server access", True, f"{user.pw_name} can write log and upload dirs and read the settings")


def admin_page_url(project: BoincProject) -> str:
    """Where make_project's Apache config serves ``html/ops/boincdl.php``: the master URL's
    last path component plus ``_ops`` (``/<project>_ops``)."""
    master = (project.config.get("master_url") or "").rstrip("/")
    if not master:
        return "html/ops/boincdl.php (no <master_url> in config.xml)"
    return f"{master}_ops/boincdl.php"


def check_admin_page(project: BoincProject) -> Finding:
    ops = project.root / "html" / "ops"
    url = admin_page_url(project)
    if (ops / ".htaccess").is_file() and not (ops / ".htpasswd").is_file():
        return Finding("admin page", False, f"{url} needs {ops / '.htpasswd'} (html/ops/.htaccess asks for it)",
                       f"htpasswd -c {ops / '.htpasswd'} <admin name>")
    return Finding("admin page", True, url)


def check_project_name(project: BoincProject) -> Finding:
    inc = project.root / "html" / "project" / "project.inc"
    try:
        text = inc.read_text(errors="replace")
    except OSError:
        return Finding("project name", True, "no html/project/project.inc")
    if PLACEHOLDER_NAME in text:
        return Finding("project name", False, f"{inc} still names the project '{PLACEHOLDER_NAME}' "
                       "(every page title, the admin page's included)",
                       f"edit PROJECT (and COPYRIGHT_HOLDER) in {inc}")
    return Finding("project name", True, "set in html/project/project.inc")


def check_app_version(project: BoincProject) -> Finding:
    versions = sorted(project.apps_dir.glob("boincdl/*/*/version.xml"))
    if not versions:
        return Finding("app version", False, "no boinc-dl app version in apps/boincdl/",
                       "boinc-dl boinc install ... --wrapper <BOINC's wrapper for x86_64-pc-linux-gnu> "
                       "(built from BOINC's samples/wrapper, or a wrapper_* release binary; docs/boinc.md)")
    return Finding("app version", True, ", ".join(str(v.parent.relative_to(project.apps_dir)) for v in versions))


def tools_elsewhere(project: BoincProject) -> str:
    """Where BOINC's tools run when not here (``$BDL_BOINC_TOOL_RUNNER`` or the settings'
    ``command_prefix``, e.g. the BOINC container of the docker stack); '' when here."""
    runner = os.environ.get(ENV_TOOL_RUNNER)
    if runner:
        return f"${ENV_TOOL_RUNNER} ({runner})"
    prefix = project.settings.command_prefix
    return f"command_prefix {' '.join(prefix)}" if prefix else ""


def diagnose(project: BoincProject, web_user_name: str | None = None) -> list[Finding]:
    """Every check, in the order an admin meets them. PHP and bin/start's Python are
    checked only where BOINC's tools run (not through a runner into another container)."""
    elsewhere = tools_elsewhere(project)
    if elsewhere:
        skipped = f"BOINC's tools run through {elsewhere}: check there"
        tools = [Finding("php for bin/xadd", True, skipped), Finding("python for bin/start", True, skipped)]
    else:
        tools = [check_php(), check_python_for_start(project)]
    return [tools[0], check_db_password(project), tools[1], check_host(project),
            check_web_access(project, web_user_name), check_app_version(project), check_admin_page(project),
            check_project_name(project)]


__all__ = ["Finding", "admin_page_url", "diagnose", "user_can", "web_user"]
