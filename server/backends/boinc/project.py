"""A BOINC project directory as boinc-dl sees it.

Layout (created by BOINC's ``make_project``)::

    <project>/config.xml        <boinc><config>...</config><daemons>...</daemons></boinc>
    <project>/project.xml       apps and platforms (read by bin/xadd)
    <project>/bin/              create_work, stage_file, cancel_jobs, our shims
    <project>/templates/        input/output templates (paths stored per workunit)
    <project>/download/         download hierarchy: download/<hash>/<physical name>
    <project>/upload/           upload hierarchy:   upload/<hash>/<result>_<i>
    <project>/apps/<app>/<version>/<platform>[__<plan class>]/
    <project>/log_<host>/ pid_<host>/ tmp_<host>/   (bin/start runs daemons in tmp_<host>)

boinc-dl adds ``<project>/boinc-dl.yaml`` (its settings: the Redis URL above all)
and ``<project>/boinc-dl/jobs/<job>/`` (prepared job files, kept results).

The Redis URL is taken from the environment variable ``BDL_REDIS_URL`` if set, else
from ``redis_url`` in ``<project>/boinc-dl.yaml``.
"""

from __future__ import annotations

import hashlib
import os
import socket
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from boinc_dl.server.assimilator.connection import NoRedisURL, resolve_url
from boinc_dl.server.common.errors import BoincDLError

APP_NAME = "boincdl"
SETTINGS_FILE = "boinc-dl.yaml"
ENV_PROJECT = "BDL_PROJECT"
#: A program that runs a BOINC tool elsewhere (``RUNNER TOOL ARGS...``), e.g. in the
#: BOINC container when boinc-dl's daemons run in their own container.
ENV_TOOL_RUNNER = "BDL_BOINC_TOOL_RUNNER"
#: BOINC's trigger file: every daemon exits when it exists (sched_util_basic.cpp).
STOP_DAEMONS = "stop_daemons"


class BoincProjectError(BoincDLError):
    """The BOINC project directory is missing, malformed or not set up for boinc-dl."""


class BoincSettings(BaseModel):
    """``<project>/boinc-dl.yaml``: boinc-dl's settings for one BOINC project."""

    model_config = ConfigDict(extra="forbid")

    redis_url: str | None = Field(None, description="Redis of the job state; env BDL_REDIS_URL wins")
    jobs_dir: str | None = Field(None, description="prepared jobs (default <project>/boinc-dl/jobs)")
    min_quorum: int = Field(1, ge=1, description="1 on trusted hosts; 2+ replicates units on volunteers")
    compare_tolerance: float = Field(
        0.25, gt=0, description="replicated results match if their updates differ by at most this (relative)"
    )
    keep_weights: bool = Field(False, description="keep a copy of every merged weights file")
    keep_weights_max_bytes: int = Field(
        10 * 1024**3, gt=0, description="with keep_weights: the most bytes of weights kept per job (then none more)")
    validator_redis_wait_s: float = Field(
        20.0, ge=0, description="validator: wait this long for Redis before reporting a transient error"
    )
    command_prefix: list[str] = Field(
        default_factory=list, description="prefix for BOINC tools, e.g. [docker, exec, -i, boinc-apache]"
    )
    stage_mode: Literal["native", "stage_file"] = Field(
        "native", description="stage inputs by dir_hier_path in Python, or with bin/stage_file"
    )
    rsc_fpops_est: float = Field(3.6e12, gt=0)
    rsc_fpops_bound: float = Field(3.6e15, gt=0, description="the client aborts a task past this")
    rsc_memory_bound: float = Field(4e9, gt=0)
    gzip_outputs: bool = Field(False, description="clients gzip outputs before upload")
    batch_size: int = Field(200, ge=1, description="workunits per create_work call")
    capacity: int | None = Field(None, gt=0, description="units in flight per job (default: spec window)")
    poll_s: float = Field(5.0, gt=0, description="work generator pass interval")
    report_immediately: bool = Field(
        True, description="clients report each finished task at once (<report_immediately/> in the result template)"
    )
    daemon_sleep_s: int = Field(
        1, ge=1, description="--sleep_interval of the validator, assimilators and transitioner (install)"
    )
    fpops_from_history: bool = Field(
        True, description="derive rsc_fpops_est/bound from the job's measured unit times"
    )


def filename_hash(name: str, fanout: int) -> str:
    """BOINC's ``filename_hash``: hex of md5(name)[1:8] modulo the fanout."""
    x = int(hashlib.md5(name.encode(), usedforsecurity=False).hexdigest()[1:8], 16)
    return format(x % fanout, "x")


def dir_hier_path(name: str, root: Path, fanout: int) -> Path:
    """BOINC's ``dir_hier_path``: where a file lives in the download/upload hierarchy."""
    if fanout == 0:
        return Path(root) / name
    return Path(root) / filename_hash(name, fanout) / name


def short_hostname() -> str:
    """The host name as bin/start uses it for log_/pid_/tmp_ directories."""
    return socket.gethostname().split(".")[0]


@dataclass
class ProjectConfig:
    """The parts of ``config.xml``'s ``<config>`` section boinc-dl reads."""

    values: dict[str, str]

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.values.get(key, default)


class BoincProject:
    """Paths and settings of one BOINC project directory."""

    def __init__(self, root: str | Path, host: str | None = None):
        self.root = Path(root).expanduser().resolve()
        self.host = host or short_hostname()

    # ---- checks ---------------------------------------------------------------------------
    def require(self) -> BoincProject:
        """Fail clearly unless ``root`` looks like a BOINC project (config.xml present)."""
        if not self.root.is_dir():
            raise BoincProjectError(f"{self.root}: no such BOINC project directory")
        if not self.config_xml.is_file():
            raise BoincProjectError(f"{self.root}: not a BOINC project (no config.xml)")
        return self

    # ---- files ----------------------------------------------------------------------------
    @property
    def config_xml(self) -> Path:
        return self.root / "config.xml"

    @property
    def project_xml(self) -> Path:
        return self.root / "project.xml"

    @property
    def bin_dir(self) -> Path:
        return self.root / "bin"

    @property
    def templates_dir(self) -> Path:
        return self.root / "templates"

    @property
    def apps_dir(self) -> Path:
        return self.root / "apps"

    @property
    def plan_class_spec(self) -> Path:
        return self.root / "plan_class_spec.xml"

    @property
    def settings_file(self) -> Path:
        return self.root / SETTINGS_FILE

    @property
    def stop_daemons_file(self) -> Path:
        return self.root / STOP_DAEMONS

    @property
    def log_dir(self) -> Path:
        return self._host_dir("log")

    @property
    def tmp_dir(self) -> Path:
        return self._host_dir("tmp")

    @property
    def pid_dir(self) -> Path:
        return self._host_dir("pid")

    def _host_dir(self, kind: str) -> Path:
        # bin/start: config.<kind>_<host>_dir if set, else <project>/<kind>_<host>
        name = f"{kind}_{self.host}"
        custom = self.config.get(f"{name}_dir")
        return Path(custom) if custom else self.root / name

    @property
    def boincdl_dir(self) -> Path:
        return self.root / "boinc-dl"

    @property
    def jobs_dir(self) -> Path:
        d = self.settings.jobs_dir
        return Path(d) if d else self.boincdl_dir / "jobs"

    def job_dir(self, job: str) -> Path:
        return self.jobs_dir / job

    # ---- config.xml -----------------------------------------------------------------------
    @cached_property
    def config(self) -> ProjectConfig:
        """``<config>`` values of config.xml (text of each direct child, by tag)."""
        if not self.config_xml.is_file():
            return ProjectConfig({})
        try:
            # Not host data: the project's own config.xml (admin-written), never host data
            root = ET.parse(self.config_xml).getroot()  # nosec B314
        except ET.ParseError as e:
            raise BoincProjectError(f"{self.config_xml}: not well-formed XML: {e}") from None
        cfg = root.find("config")
        values: dict[str, str] = {}
        if cfg is not None:
            for el in cfg:
                if isinstance(el.tag, str):
                    values[el.tag] = (el.text or "").strip()
        return ProjectConfig(values)

    @property
    def download_dir(self) -> Path:
        return Path(self.config.get("download_dir") or self.root / "download")

    @property
    def upload_dir(self) -> Path:
        return Path(self.config.get("upload_dir") or self.root / "upload")

    @property
    def fanout(self) -> int:
        raw = self.config.get("uldl_dir_fanout")
        if raw is None or raw == "":
            return 1024
        try:
            return int(raw)
        except ValueError:
            raise BoincProjectError(f"{self.config_xml}: uldl_dir_fanout {raw!r} is not an integer") from None

    def download_path(self, name: str) -> Path:
        return dir_hier_path(name, self.download_dir, self.fanout)

    def upload_path(self, name: str) -> Path:
        return dir_hier_path(name, self.upload_dir, self.fanout)

    # ---- boinc-dl settings ----------------------------------------------------------------
    @cached_property
    def settings(self) -> BoincSettings:
        """``boinc-dl.yaml`` (all defaults when absent), validated with clear errors."""
        p = self.settings_file
        if not p.is_file():
            return BoincSettings()
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise BoincProjectError(f"{p}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise BoincProjectError(f"{p}: must be a YAML mapping")
        try:
            return BoincSettings.model_validate(data)
        except ValidationError as e:
            msgs = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
            raise BoincProjectError(f"{p}: {msgs}") from None

    def tool_command(self, tool: str, args: list[str]) -> list[str]:
        """The command running ``bin/<tool> args`` (run it with cwd = the project dir).

        ``$BDL_BOINC_TOOL_RUNNER`` (``RUNNER TOOL ARGS``) wins, then the settings'
        ``command_prefix`` (e.g. ``[docker, exec, -i, -w, <project>, <container>]``).
        """
        runner = os.environ.get(ENV_TOOL_RUNNER)
        if runner:
            return [runner, tool, *args]
        return [*self.settings.command_prefix, f"bin/{tool}", *args]

    def redis_url(self, explicit: str | None = None) -> str:
        """``explicit``, else env ``BDL_REDIS_URL``, else ``redis_url`` of boinc-dl.yaml
        (:func:`~boinc_dl.server.assimilator.connection.resolve_url`); a clear error if none."""
        try:
            return resolve_url(explicit, self.settings.redis_url, str(self.settings_file))
        except NoRedisURL as e:
            raise BoincProjectError(f"{e} (boinc-dl boinc install --redis-url ... writes it)") from None


def find_project(start: str | Path | None = None) -> BoincProject:
    """The project for a script run by BOINC: env ``BDL_PROJECT``, else the nearest
    ancestor of ``start`` (default: the working directory, ``tmp_<host>``) holding config.xml."""
    env = os.environ.get(ENV_PROJECT)
    if env:
        return BoincProject(env).require()
    here = Path(start or os.getcwd()).resolve()
    for d in (here, *here.parents):
        if (d / "config.xml").is_file():
            return BoincProject(d)
    raise BoincProjectError(f"no BOINC project (config.xml) at or above {here}; give --project")
