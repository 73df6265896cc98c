"""``boinc-dl boinc install <project>``: set a BOINC project up for boinc-dl, idempotently.

What it does (each step reports what it changed; a second run changes nothing):

1. ``boinc-dl.yaml``: boinc-dl's settings (Redis URL), created 0640 if missing (the admin page, run by the web server in the project's group, reads it too);
2. ``templates/boincdl_in`` and ``templates/boincdl_out`` (create_work's defaults for
   app ``boincdl``);
3. shims in ``bin/``: ``bdl_assimilate``, ``bdl_validate``, ``bdl_compare``,
   ``bdl_work_generator`` (POSIX sh, exec boinc-dl with the project pinned);
4. ``project.xml``: the app ``boincdl`` (and the x86_64 Linux platform);
5. app versions ``apps/boincdl/<v>/x86_64-pc-linux-gnu[__bdl_nvidia]/``: BOINC's
   wrapper as main program, ``job.xml``, the launcher, ``version.xml``; with
   ``--docker-wrapper``, also the Docker app versions
   ``apps/boincdl/<v>/<platform>__bdl_docker[_nvidia]/`` and their plan classes
   (:mod:`~boinc_dl.server.backends.boinc.docker_app`);
6. ``plan_class_spec.xml``: the ``bdl_nvidia`` plan class for current NVIDIA GPUs;
7. ``config.xml``: the work generator, ``script_validator`` and P ``script_assimilator
   --mod P i`` daemons, each with its own ``<output>`` and ``<pid_file>`` (bin/start
   derives the lock file from the output name, so two instances sharing one output
   would lock each other out);
8. the admin page into ``html/ops/`` when the package ships it;
9. ``config.xml``: ``<next_rpc_delay>`` in ``<config>`` (hosts come back and ask for
   work despite BOINC's work-fetch backoff), ``<maintenance_delay>`` and
   ``<min_sendwork_interval>`` (0: no ``request_delay`` between a host's scheduler
   requests, so finished tasks are reported promptly); see
   :mod:`boinc_dl.server.backends.boinc.host_contact`;
10. with ``min_quorum`` >= 2, ``config.xml``'s ``<one_result_per_user_per_wu>`` (or
   ``<one_result_per_host_per_wu>``): replicas go to different users or hosts
   (:mod:`.quorum`);
11. ``config_aux.xml``: at most ``jobs_per_slot`` boincdl tasks in progress per CPU/GPU
   of a host, so one host cannot take every unit in flight (:mod:`.host_limits`);
12. ``bin/xadd`` and ``bin/update_versions`` when BOINC's database lacks the app, a
   platform or an app version (read from the database; when it cannot be read, when
   project.xml or the app versions changed; ``--no-db`` skips them);
13. the prerequisite checks of ``boinc-dl boinc doctor`` (:mod:`.doctor`): each failure
   becomes a note saying what to fix.

App version files are immutable for BOINC (``tools/update_versions`` refuses a file
whose name is staged with other content): changing them needs a new ``--app-version``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from boinc_dl.server.backends.boinc import artifacts, docker_app
from boinc_dl.server.backends.boinc.host_contact import (
    DEFAULT_MAINTENANCE_DELAY_S,
    DEFAULT_MIN_SENDWORK_INTERVAL_S,
    DEFAULT_NEXT_RPC_DELAY_S,
    request_delay_s,
    requests_per_host_hour,
    set_maintenance_delay,
    set_min_sendwork_interval,
    set_next_rpc_delay,
)
from boinc_dl.server.backends.boinc.host_limits import (
    CONFIG_AUX,
    DEFAULT_JOBS_PER_SLOT,
    set_jobs_per_slot,
)
from boinc_dl.server.backends.boinc.project import APP_NAME, BoincProject, BoincProjectError
from boinc_dl.server.backends.boinc.quorum import replicas_across, set_quorum_flags
from boinc_dl.server.backends.boinc.xmlmerge import (
    XmlDoc,
    append_child,
    child_text,
    remove_child,
    replace_child,
    simple,
    upsert_named,
)

SHIMS = {
    "bdl_assimilate": "assimilate",
    "bdl_validate": "validate-init",
    "bdl_compare": "validate-compare",
    "bdl_work_generator": "work-generator",
}
WORK_GENERATOR_OUTPUT = "bdl_work_generator.log"
VALIDATOR_OUTPUT = "bdl_validator.log"
ASSIMILATOR_OUTPUT = "bdl_assimilator_{i}.log"
DEFAULT_APP_VERSION = "1.0"


@dataclass
class InstallOptions:
    """Choices of ``boinc-dl boinc install``."""

    redis_url: str | None = None
    assimilators: int = 2
    app_version: str = DEFAULT_APP_VERSION
    wrapper: Path | None = None
    gpu: bool = True
    command: list[str] | None = None
    min_quorum: int | None = None
    gzip_outputs: bool | None = None
    run_db_tools: bool = True
    force_db: bool = False
    #: ``<next_rpc_delay>`` seconds in config.xml (0 removes it).
    next_rpc_delay_s: float = DEFAULT_NEXT_RPC_DELAY_S
    #: ``<maintenance_delay>`` seconds in config.xml: how long a host that asks while the
    #: project is stopped stays away (BOINC's default, 3600, when 0).
    maintenance_delay_s: float = DEFAULT_MAINTENANCE_DELAY_S
    #: ``<min_sendwork_interval>`` whole seconds in config.xml (0: replies carry no
    #: ``request_delay``, so a finished task is reported at the client's next poll).
    min_sendwork_interval_s: int = DEFAULT_MIN_SENDWORK_INTERVAL_S
    #: app versions for BOINC's docker_wrapper (none unless it names a docker_wrapper)
    docker: docker_app.DockerOptions = field(default_factory=docker_app.DockerOptions)
    #: With ``min_quorum`` >= 2: the replicas of a unit go to different ``users``
    #: (volunteers) or only to different ``hosts`` (a fleet attached with one account).
    quorum_across: str = "users"
    #: Tasks of app boincdl in progress per CPU (and per GPU) of a host (config_aux.xml;
    #: 0 removes the cap).
    jobs_per_slot: int = DEFAULT_JOBS_PER_SLOT
    #: Run the prerequisite checks of ``boinc-dl boinc doctor`` and report what fails.
    checks: bool = True


@dataclass
class InstallReport:
    """What changed, and what the admin should know."""

    changes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def default_command() -> list[str]:
    """How shims start boinc-dl: this Python, module ``server.backends.boinc`` (works under cron)."""
    return [sys.executable, "-m", "boinc_dl.server.backends.boinc"]


def daemon_specs(n_assimilators: int, sleep_s: int | None = None) -> list[dict[str, str]]:
    """Our ``<daemon>`` entries: cmd, output, pid_file.

    ``sleep_s`` is the daemons' ``--sleep_interval``: how long an idle validator or
    assimilator waits before it looks for work again (BOINC's defaults: 5 s,
    ``sched/validator.cpp``; 10 s, ``sched/assimilator.cpp``). Each idle wake-up costs
    one indexed query; each second of sleep adds up to a second to every merge.
    """
    sleep = f" --sleep_interval {int(sleep_s)}" if sleep_s else ""
    specs = [
        {"cmd": "bdl_work_generator", "output": WORK_GENERATOR_OUTPUT, "pid_file": "bdl_work_generator.pid"},
        {"cmd": f"script_validator --app {APP_NAME} --init_script bdl_validate --compare_script bdl_compare{sleep}",
         "output": VALIDATOR_OUTPUT, "pid_file": "bdl_validator.pid"},
    ]
    for i in range(n_assimilators):
        specs.append({
            "cmd": f"script_assimilator --app {APP_NAME} --script bdl_assimilate --mod {n_assimilators} {i}{sleep}",
            "output": ASSIMILATOR_OUTPUT.format(i=i), "pid_file": f"bdl_assimilator_{i}.pid",
        })
    return specs


# BOINC's own daemons on every unit's path, and why their idle sleep matters (each given
# ``--sleep_interval`` = the settings' ``daemon_sleep_s`` unless the admin set one).
LATENCY_DAEMONS = {
    # sleeps 5 s when its scan added nothing (sched/feeder.cpp): a new workunit becomes
    # sendable up to 5 s late, and a host that asks just before then gets "no tasks"
    "feeder": "prompt sending",
    # runs twice between a report and the assimilator (to validation, then to
    # assimilation) and sleeps 5 s when idle (sched/transitioner.cpp)
    "transitioner": "prompt assimilation",
}


def daemon_latency(daemons: ET.Element, sleep_s: int) -> list[tuple[str, str]]:
    """Give BOINC's feeder and transitioner ``--sleep_interval sleep_s`` unless they have
    one; the (new command, why) of each change."""
    changed = []
    for el in daemons.findall("daemon"):
        words = child_text(el, "cmd").split()
        if not words or words[0] not in LATENCY_DAEMONS:
            continue
        if any(w.lstrip("-") == "sleep_interval" for w in words):
            continue
        cmd = " ".join([*words, "--sleep_interval", str(int(sleep_s))])
        cmd_el = el.find("cmd")
        assert cmd_el is not None
        cmd_el.text = cmd
        changed.append((cmd, LATENCY_DAEMONS[words[0]]))
    return changed


def is_our_daemon(el: ET.Element) -> bool:
    """A ``<daemon>`` that boinc-dl manages (by its output name or command)."""
    out = child_text(el, "output")
    if re.fullmatch(r"bdl_(work_generator|validator|assimilator_\d+)\.log", out):
        return True
    words = child_text(el, "cmd").split()
    if not words:
        return False
    if words[0] == "bdl_work_generator":
        return True
    apps = [words[i + 1] for i, w in enumerate(words[:-1]) if w in ("--app", "-app")]
    return words[0] in ("script_validator", "script_assimilator") and apps == [APP_NAME]


def _keep_group(tmp: Path, like: Path) -> None:
    """Give a file install writes the group of the file it replaces (else of the project
    directory): the web server reads ``boinc-dl.yaml`` (0640) through the project's group,
    and a rewrite by root must not take that away."""
    try:
        gid = like.stat().st_gid
        if tmp.stat().st_gid != gid:
            os.chown(tmp, -1, gid)
    except OSError:
        pass  # not ours to change: the admin's umask and groups decide


class Installer:
    """Runs the install steps against one project (see module docstring)."""

    def __init__(self, project: BoincProject, opts: InstallOptions):
        self.p = project
        self.o = opts
        self.report = InstallReport()

    def change(self, what: str) -> None:
        self.report.changes.append(what)

    def note(self, what: str) -> None:
        self.report.notes.append(what)

    def rel(self, path: Path) -> str:
        try:
            return str(path.relative_to(self.p.root))
        except ValueError:
            return str(path)

    # ---- files ----------------------------------------------------------------------------
    def write_file(self, path: Path, text: str | bytes, mode: int | None = None) -> bool:
        """Create or update a file we own; True if written."""
        data = text.encode() if isinstance(text, str) else text
        if path.exists() and path.read_bytes() == data:
            if mode is not None and (path.stat().st_mode & 0o777) != mode:
                path.chmod(mode)
                self.change(f"chmod {mode:o} {self.rel(path)}")
            return False
        existed = path.exists()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data)
        _keep_group(tmp, path if existed else self.p.root)
        if mode is not None:
            tmp.chmod(mode)
        tmp.replace(path)
        self.change(f"{'updated' if existed else 'created'} {self.rel(path)}")
        return True

    # ---- steps ----------------------------------------------------------------------------
    def settings(self) -> None:
        path = self.p.settings_file
        data: dict = {}
        if path.exists():
            loaded = yaml.safe_load(path.read_text()) or {}
            if not isinstance(loaded, dict):
                raise BoincProjectError(f"{path}: must be a YAML mapping")
            data = dict(loaded)
        wanted = {"redis_url": self.o.redis_url, "min_quorum": self.o.min_quorum,
                  "gzip_outputs": self.o.gzip_outputs}
        new = dict(data)
        for k, v in wanted.items():
            if v is not None:
                new[k] = v
        if path.exists() and new == data:
            return
        header = ("# boinc-dl settings for this BOINC project (see docs/boinc.md).\n"
                  "# BDL_REDIS_URL in the environment overrides redis_url.\n")
        self.write_file(path, header + yaml.safe_dump(new or {"redis_url": None}, sort_keys=False), mode=0o640)
        self.p.__dict__.pop("settings", None)
        if not new.get("redis_url"):
            self.note(f"set redis_url in {path} (or BDL_REDIS_URL) before starting the daemons")

    def templates(self) -> None:
        t = self.p.templates_dir
        self.write_file(t / f"{APP_NAME}_in", artifacts.input_template())
        gz = bool(self.o.gzip_outputs if self.o.gzip_outputs is not None else self.p.settings.gzip_outputs)
        self.write_file(t / f"{APP_NAME}_out", artifacts.output_template(artifacts.GENERIC_MAX_NBYTES, gz,
                                                                        self.p.settings.report_immediately))

    def shims(self) -> None:
        cmd = self.o.command or default_command()
        for name, sub in SHIMS.items():
            text = artifacts.shim(cmd, self.p.root, sub, pass_args=sub != "work-generator")
            self.write_file(self.p.bin_dir / name, text, mode=0o755)

    def project_xml(self) -> bool:
        doc = XmlDoc.load(self.p.project_xml, "boinc", create=True)
        root = doc.root
        if not any(child_text(pl, "name") == artifacts.CPU_PLATFORM for pl in root.findall("platform")):
            append_child(root, simple("platform", [
                ("name", artifacts.CPU_PLATFORM),
                ("user_friendly_name", "Linux running on an AMD x86_64 or Intel EM64T CPU")]), 0)
            doc.changes.append(f"platform {artifacts.CPU_PLATFORM}")
        if not any(child_text(a, "name") == APP_NAME for a in root.findall("app")):
            append_child(root, simple("app", [("name", APP_NAME),
                                              ("user_friendly_name", "boinc-dl deep-learning training")]), 0)
            doc.changes.append(f"app {APP_NAME}")
        if doc.save():
            self.change(f"project.xml: added {', '.join(doc.changes)}")
            return True
        return False

    def app_versions(self) -> bool:
        ver = self.o.app_version
        if not re.fullmatch(r"\d+(\.\d+)?", ver):
            raise BoincProjectError(f"--app-version {ver!r}: must be N or N.M (e.g. 1.0)")
        plats = [artifacts.CPU_PLATFORM]
        if self.o.gpu:
            plats.append(f"{artifacts.CPU_PLATFORM}__{artifacts.GPU_PLAN_CLASS}")
        changed = False
        for plat in plats:
            d = self.p.apps_dir / APP_NAME / ver / plat
            wrapper = self.o.wrapper
            if wrapper is None and d.is_dir():
                found = sorted(f for f in d.iterdir() if f.name.startswith("wrapper") and f.is_file())
                wrapper = found[0] if found else None
            if wrapper is None:
                self.note(f"app version {ver} {plat} not installed: pass --wrapper <BOINC wrapper binary "
                          f"for {artifacts.CPU_PLATFORM}>")
                continue
            wrapper = Path(wrapper)
            if not wrapper.is_file():
                raise BoincProjectError(f"--wrapper {wrapper}: no such file")
            launcher = f"bdl_launcher_{ver}.sh"
            job = f"bdl_job_{ver}.xml"
            files: dict[str, tuple[bytes, int]] = {
                wrapper.name: (wrapper.read_bytes(), 0o755),
                launcher: (artifacts.launcher().encode(), 0o755),
                job: (artifacts.job_xml().encode(), 0o644),
                "version.xml": (artifacts.version_xml(wrapper.name, launcher, job).encode(), 0o644),
            }
            changed |= docker_app.write_version_dir(self, d, files, ver)
        return changed

    def docker_app_versions(self) -> tuple[bool, bool]:
        """App versions for hosts with Docker or Podman and nothing else (module
        :mod:`~boinc_dl.server.backends.boinc.docker_app`): whether project.xml changed,
        and whether a version was added."""
        d = docker_app.DockerVersions(self.p.root, self.p.apps_dir, self.o.app_version, self.o.gpu,
                                      self.o.docker, self)
        project_changed = d.platforms(self.p.project_xml)
        versions_changed = d.app_versions()
        d.plan_classes(self.p.plan_class_spec)
        return project_changed, versions_changed

    def plan_class(self) -> None:
        if not self.o.gpu:
            return
        existed = self.p.plan_class_spec.exists()
        doc = XmlDoc.load(self.p.plan_class_spec, "plan_classes", create=True)
        done = upsert_named(doc, "plan_class", artifacts.gpu_plan_class())
        if not done:
            return
        doc.save()
        self.change(f"plan_class_spec.xml: {done} plan class {artifacts.GPU_PLAN_CLASS}")
        if not existed:
            self.note("plan_class_spec.xml is new: with it the scheduler no longer knows BOINC's built-in "
                      "plan classes; describe any other app's plan classes there too")

    def daemons(self) -> None:
        doc = XmlDoc.load(self.p.config_xml, "boinc")
        root = doc.root
        daemons = root.find("daemons")
        if daemons is None:
            daemons = ET.Element("daemons")
            append_child(root, daemons, 0)
            doc.changes.append("added <daemons>")
        sleep_s = self.p.settings.daemon_sleep_s
        want = daemon_specs(self.o.assimilators, sleep_s)
        by_output = {d["output"]: d for d in want}
        seen: set[str] = set()
        for el in list(daemons.findall("daemon")):
            if not is_our_daemon(el):
                continue
            out = child_text(el, "output")
            spec = by_output.get(out)
            if spec is None or out in seen:
                remove_child(daemons, el)
                doc.changes.append(f"removed daemon '{child_text(el, 'cmd')}'")
                continue
            seen.add(out)
            if child_text(el, "cmd") != spec["cmd"] or child_text(el, "pid_file") != spec["pid_file"]:
                new = self._daemon_el(spec)
                disabled = el.find("disabled")
                if disabled is not None:
                    new.append(disabled)
                replace_child(daemons, el, new, 1)
                doc.changes.append(f"updated daemon '{spec['cmd']}'")
        for spec in want:
            if spec["output"] not in seen:
                append_child(daemons, self._daemon_el(spec), 1)
                doc.changes.append(f"added daemon '{spec['cmd']}'")
        for cmd, why in daemon_latency(daemons, sleep_s):
            doc.changes.append(f"updated daemon '{cmd}' ({why}, docs/boinc.md)")
        if doc.save():
            for c in doc.changes:
                self.change(f"config.xml: {c}")

    @staticmethod
    def _daemon_el(spec: dict[str, str]) -> ET.Element:
        return simple("daemon", [("cmd", spec["cmd"]), ("output", spec["output"]), ("pid_file", spec["pid_file"])])

    def host_contact(self) -> None:
        """``<next_rpc_delay>``: hosts come back and ask for work despite a work-fetch backoff;
        ``<maintenance_delay>``: a host that asks during a restart stays away this long;
        ``<min_sendwork_interval>``: every reply's request_delay holds back the next report
        (docs/boinc.md, latency)."""
        o, xml = self.o, self.p.config_xml
        self._config_setting(
            set_next_rpc_delay(xml, o.next_rpc_delay_s), o.next_rpc_delay_s > 0,
            f"next_rpc_delay {o.next_rpc_delay_s:g} s: every host contacts the scheduler at least "
            f"{requests_per_host_hour(o.next_rpc_delay_s):g} times an hour (for every app of the project)")
        self._config_setting(set_maintenance_delay(xml, o.maintenance_delay_s), False, "")
        self._config_setting(
            set_min_sendwork_interval(xml, o.min_sendwork_interval_s), o.min_sendwork_interval_s > 0,
            f"min_sendwork_interval {o.min_sendwork_interval_s} s: every scheduler reply defers the host's "
            f"next request (a finished task's report included) by {request_delay_s(o.min_sendwork_interval_s):g} s")

    def _config_setting(self, changes: list[str], costly: bool, cost: str) -> None:
        """Report a config.xml setting's changes, and its cost when it changed and costs."""
        for c in changes:
            self.change(f"config.xml: {c}")
        if changes and costly:
            self.note(cost)

    def quorum(self) -> None:
        """With ``min_quorum`` >= 2, BOINC must send a unit's replicas to different users
        (or hosts): otherwise one host compares itself with itself (:mod:`.quorum`)."""
        q = self.p.settings.min_quorum
        for c in set_quorum_flags(self.p.config_xml, q, self.o.quorum_across):  # type: ignore[arg-type]
            self.change(f"config.xml: {c}")
        if q >= 2:
            across = replicas_across(self._config())
            self.note(f"min_quorum {q}: BOINC sends the replicas of a workunit to different {across} "
                      "(config.xml, every app of the project); the admin page counts the comparisons "
                      "made across hosts and users")
        elif replicas_across(self._config()) == "users":
            self.note("config.xml's <one_result_per_user_per_wu> is on: the replica of a unit the work "
                      "generator spot-checks for the loss check goes to another account, so on a fleet whose "
                      "hosts all attach with one account it is never sent and its unit waits for its deadline "
                      "(set the element to 0 there, or validation.loss_check_spot_every: 0)")

    def _config(self) -> dict[str, str]:
        self.p.__dict__.pop("config", None)
        return self.p.config.values

    def host_limits(self) -> None:
        """A per-host cap on boincdl tasks in progress, per CPU/GPU (:mod:`.host_limits`)."""
        for c in set_jobs_per_slot(self.p.root, self.o.jobs_per_slot):
            self.change(f"{CONFIG_AUX}: {c}")

    def prerequisites(self) -> None:
        """The checks of ``boinc-dl boinc doctor``: each one that fails becomes a note."""
        from boinc_dl.server.backends.boinc.doctor import diagnose

        for f in diagnose(self.p):
            if not f.ok and f.name != "app version":
                self.note(f"{f.name}: {f.detail}; fix: {f.fix}")

    def admin_page(self) -> None:
        try:
            html = resources.files("boinc_dl.server.backends.boinc").joinpath("html")
            pages = [f for f in html.iterdir() if f.name.endswith(".php")] if html.is_dir() else []
        except (FileNotFoundError, NotADirectoryError):
            pages = []
        ops = self.p.root / "html" / "ops"
        for page in pages:
            if ops.is_dir():
                self.write_file(ops / page.name, page.read_bytes(), 0o644)

    def db_tools(self, project_changed: bool, versions_changed: bool) -> None:
        """Run ``bin/xadd`` / ``bin/update_versions`` when BOINC's database lacks the app, its
        platform or an app version found under ``apps/boincdl/`` (judged against the
        database, so a run that failed at ``xadd`` is repaired by the next one); when the
        database cannot be read from here, when the files changed."""
        if not self.o.run_db_tools:
            if project_changed or versions_changed:
                self.note("database not updated (--no-db): run bin/xadd and bin/update_versions "
                          "in the project directory")
            return
        missing = self._db_missing()
        for_xadd, for_versions = missing if missing is not None else ([], [])
        need_xadd = project_changed or bool(for_xadd)
        need_versions = versions_changed or bool(for_versions)

        def why(items: list[str]) -> str:
            return f" (BOINC's database lacked {', '.join(items)})" if items else ""

        if need_xadd or self.o.force_db:
            self._tool(self.p.tool_command("xadd", []), None)
            self.change(f"ran bin/xadd{why(for_xadd)}")
        if need_xadd or need_versions or self.o.force_db:
            # --noconfirm on current servers; release 1.2 ignores arguments and asks on stdin
            self._tool(self.p.tool_command("update_versions", ["--noconfirm"]), "y\n" * 50)
            self.change(f"ran bin/update_versions{why(for_versions)}")
        if missing is not None and (need_xadd or need_versions):
            after = self._db_missing()
            if after and (after[0] or after[1]):
                raise BoincProjectError("bin/xadd and bin/update_versions ran, but BOINC's database still lacks "
                                        f"{', '.join(after[0] + after[1])}: run them in {self.p.root} to see why")

    def expected_app_versions(self) -> list[tuple[int, str, str]]:
        """(version_num, platform, plan class) of every app version directory of app
        boincdl, as ``bin/update_versions`` registers them (``parse_version``: "1.0" is 100)."""
        out = []
        for vx in sorted((self.p.apps_dir / APP_NAME).glob("*/*/version.xml")):
            plat, ver = vx.parent.name, vx.parent.parent.name
            major, _, minor = ver.partition(".")
            if not major.isdigit() or (minor and not minor.isdigit()):
                continue  # update_versions skips what it cannot parse (version -1)
            num = int(major) * 100 + int(minor) if minor else int(major)
            platform, _, plan = plat.partition("__")
            out.append((num, platform, plan))
        return out

    def _db_missing(self) -> tuple[list[str], list[str]] | None:
        """What BOINC's database lacks: (app and platforms for xadd, app versions for
        update_versions); None when the database cannot be read from here (noted)."""
        from boinc_dl.server.backends.boinc.boincdb import BoincDB, BoincDBError

        want = self.expected_app_versions()
        try:
            with BoincDB.connect(self.p) as db:
                have_app = db.app_exists(APP_NAME)
                platforms = db.platform_names()
                versions = db.app_versions(APP_NAME) if have_app else set()
        except BoincDBError as e:
            self.note(f"BOINC's database not readable from here ({e}): bin/xadd and bin/update_versions "
                      "run only when install changes their files; if an earlier run failed in them, "
                      "repeat it with --force-db")
            return None
        for_xadd = [] if have_app else [f"app {APP_NAME}"]
        for_xadd += [f"platform {p}" for p in sorted({p for _, p, _ in want} - platforms)]
        for_versions = [f"app version {n / 100:.2f} {p}{'__' + c if c else ''}" for n, p, c in want
                        if (n, p, c) not in versions]
        return for_xadd, for_versions

    def _tool(self, cmd: list[str], stdin: str | None) -> None:
        try:
            proc = subprocess.run(cmd, cwd=self.p.root, input=stdin, capture_output=True, text=True, timeout=600)
        except FileNotFoundError:
            raise BoincProjectError(f"{cmd[0]} not found: is {self.p.root} a BOINC project?") from None
        if proc.returncode != 0 or "Error" in proc.stdout:
            raise BoincProjectError(f"{' '.join(cmd)} failed (exit {proc.returncode}): "
                                    f"{(proc.stdout + proc.stderr).strip()[-800:]}")

    def run(self) -> InstallReport:
        self.p.require()
        if not self.p.bin_dir.is_dir():
            raise BoincProjectError(f"{self.p.root}: no bin/ directory (not a BOINC project?)")
        if self.o.assimilators < 1:
            raise BoincProjectError("--assimilators must be at least 1")
        self.settings()
        self.templates()
        self.shims()
        project_changed = self.project_xml()
        versions_changed = self.app_versions()
        docker_project, docker_versions = self.docker_app_versions()
        project_changed, versions_changed = project_changed or docker_project, versions_changed or docker_versions
        self.plan_class()
        self.daemons()
        self.host_contact()
        self.quorum()
        self.host_limits()
        self.admin_page()
        self.db_tools(project_changed, versions_changed)
        if self.o.checks:
            self.prerequisites()
        if self.report.changes:
            self.note(f"restart the daemons: boinc-dl boinc restart --project {self.p.root} "
                      "(a plain 'bin/stop && bin/start' can leave a daemon stopped)")
        return self.report


def install(project_dir: str | Path, opts: InstallOptions | None = None) -> InstallReport:
    """Install boinc-dl into a BOINC project (idempotent); what changed."""
    return Installer(BoincProject(project_dir), opts or InstallOptions()).run()


__all__ = ["InstallOptions", "InstallReport", "install", "daemon_specs", "is_our_daemon"]
