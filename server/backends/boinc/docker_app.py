"""App versions for BOINC's Docker apps: boinc-dl for hosts with nothing installed.

A BOINC client 8.2 or later detects Docker or Podman (on Windows, a WSL distro with
one) and reports it in every scheduler request; a plan class with ``<docker/>`` sends
an app version only to such hosts (``sched/plan_class_spec.cpp``). The app version's
main program is BOINC's ``docker_wrapper`` (``samples/docker_wrapper``). In the task's
slot directory it builds the image from the ``Dockerfile`` there unless an image of
job.toml's ``image_name`` exists, creates a container with the slot directory mounted
at ``workdir`` and the project directory at ``project_dir_mount``, starts it, pauses
and unpauses it when the client suspends and resumes the task, kills it on abort, and
ends the task with the container's exit status. What this module puts into
``apps/boincdl/<v>/<platform>__<plan class>/``:

* docker_wrapper (main program), built for the platform;
* ``Dockerfile``, ``job.toml``, ``bdl-requirements.txt``, ``docker_main.sh`` and the
  boinc-dl wheel, each ``<copy_file/>``: docker_wrapper reads job.toml and builds from
  the slot directory, where a BOINC link file would be read as content;
* ``version.xml`` with ``<is_wrapper/>``.

Facts from BOINC's source that shape it (client 8.2.15, docker_wrapper 22):

* The plan class name must contain ``docker``: the client marks such app versions as
  Docker apps (``client/client_types.cpp``) and keeps their containers at start-up.
* Without ``image_name`` the image is named per workunit and removed after each task:
  every task would build it. With it, the image is kept and reused.
* The client removes, at every start, each image whose name starts with ``boinc__``
  that no running task uses (``CLIENT_STATE::docker_cleanup``, ``client/cs_apps.cpp``):
  our names start with ``bdl-`` so that a host keeps its image across restarts.
* ``image_exists`` looks for ``<image_name> `` in ``docker images`` output, where the
  engine prints ``localhost/<name>  <tag>``: the name carries no tag.
* ``build_args`` and ``create_args`` reach the engine through ``popen`` (a shell):
  only shell-inert characters are accepted here.
* ``use_gpu`` adds ``--gpus all``; the task's GPU is then chosen by the client app from
  ``init_data.xml`` (``CUDA_VISIBLE_DEVICES``), as in the venv app version.

The image name is derived from everything the image is built from (Dockerfile, entry
point, pinned requirements, the wheel's content, build arguments), so two projects or
app versions built from the same files share an image, and any change gives a new one.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata, resources
from pathlib import Path
from typing import Protocol

from boinc_dl.server.backends.boinc.artifacts import gpu_plan_class
from boinc_dl.server.backends.boinc.project import APP_NAME, BoincProjectError
from boinc_dl.server.backends.boinc.xmlmerge import (
    XmlDoc,
    append_child,
    child_text,
    simple,
    to_xml,
    upsert_named,
)

LINUX_PLATFORM = "x86_64-pc-linux-gnu"
WINDOWS_PLATFORM = "windows_x86_64"
PLATFORM_NAMES = {
    LINUX_PLATFORM: "Linux running on an AMD x86_64 or Intel EM64T CPU",
    WINDOWS_PLATFORM: "Microsoft Windows running on an AMD x86_64 or Intel EM64T CPU",
}
CPU_PLAN_CLASS = "bdl_docker"
GPU_PLAN_CLASS = "bdl_docker_nvidia"
DEFAULT_BASE_IMAGE = "python:3.11-slim-bookworm"
#: Where the slot directory and the project directory appear in the container.
WORKDIR = "/app"
PROJECT_MOUNT = "/project"
#: job.toml keys docker_wrapper 22 reads (``parse_config_file``); anything else is ignored.
JOB_TOML_KEYS = frozenset({"workdir", "project_dir_mount", "image_name", "use_gpu", "web_graphics_guest_port",
                           "mount", "portmap", "build_args", "create_args", "verbose"})
# Logical names in the slot directory (the Dockerfile's COPY sources and docker_wrapper's defaults).
DOCKERFILE = "Dockerfile"
JOB_TOML = "job.toml"
REQUIREMENTS = "bdl-requirements.txt"
ENTRY = "docker_main.sh"
# What may reach docker_wrapper's shell command lines (build_args).
_SHELL_INERT = re.compile(r"[A-Za-z0-9_./:@=,+%-]+")
# A reference to an image: [registry[:port]/]path[:tag][@digest].
_IMAGE_REF = re.compile(r"[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
                        r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?")
# A wheel file name (PEP 427) of boinc-dl.
_WHEEL_NAME = re.compile(r"boinc_dl-[0-9][A-Za-z0-9_.+!]*-py3-none-any\.whl")


@dataclass(frozen=True)
class Flavour:
    """One kind of Docker app version: CPU, or NVIDIA GPU."""

    name: str
    plan_class: str
    use_gpu: bool
    #: the pip requirement of TensorFlow, formatted with its version
    tensorflow: str


CPU = Flavour("cpu", CPU_PLAN_CLASS, False, "tensorflow-cpu=={version}")
NVIDIA = Flavour("nvidia", GPU_PLAN_CLASS, True, "tensorflow[and-cuda]=={version}")


@dataclass
class DockerOptions:
    """The ``--docker-*`` choices of ``boinc-dl boinc install``."""

    #: (platform, docker_wrapper binary) pairs
    wrappers: list[tuple[str, Path]] = field(default_factory=list)
    base_image: str = DEFAULT_BASE_IMAGE
    #: more arguments for the host's ``docker build`` / ``podman build``
    build_args: list[str] = field(default_factory=list)
    #: boinc-dl's wheel; built from the installed source tree when not given
    wheel: Path | None = None


class Sink(Protocol):
    """What the installer offers: write a file it owns, report a change or a note."""

    def write_file(self, path: Path, text: str | bytes, mode: int | None = None) -> bool: ...

    def change(self, what: str) -> None: ...

    def note(self, what: str) -> None: ...

    def rel(self, path: Path) -> str: ...


def write_version_dir(sink: Sink, d: Path, files: dict[str, tuple[bytes, int]], version: str) -> bool:
    """Write one app version's directory ``d`` (name -> (bytes, mode)); True if written.
    An existing directory must hold the same bytes: BOINC app version files are immutable
    (clients cache them by name), so a change needs a new version number."""
    if d.is_dir():
        differ = [n for n, (data, _) in files.items() if not (d / n).is_file() or (d / n).read_bytes() != data]
        if differ:
            raise BoincProjectError(
                f"{sink.rel(d)} exists with other {', '.join(differ)}: BOINC app version files are "
                f"immutable; install a new version with --app-version (current: {version})")
        return False
    for name, (data, mode) in files.items():
        sink.write_file(d / name, data, mode)
    return True


# ---- the files -------------------------------------------------------------------------------


def _read(name: str) -> bytes:
    return resources.files("boinc_dl.server.backends.boinc").joinpath("files", name).read_bytes()


def dockerfile() -> bytes:
    """The Dockerfile of every Docker app version."""
    return _read(DOCKERFILE)


def entry_script() -> bytes:
    """The container's entry point (``docker_main.sh``)."""
    return _read(ENTRY)


def platform_of(spec: str) -> tuple[str, Path]:
    """``PLATFORM=PATH`` or a docker_wrapper file named as BOINC names its builds
    (``docker_wrapper_22_x86_64-pc-linux-gnu``, ``docker_wrapper_22_windows_x86_64.exe``)."""
    if "=" in spec and spec.split("=", 1)[0] in PLATFORM_NAMES:
        plat, path = spec.split("=", 1)
        return plat, Path(path)
    name = Path(spec).name
    found = [p for p in PLATFORM_NAMES if p in name]
    if len(found) != 1:
        raise BoincProjectError(
            f"--docker-wrapper {spec}: cannot tell its platform from the file name; write "
            f"PLATFORM=PATH with PLATFORM one of {', '.join(PLATFORM_NAMES)}")
    return found[0], Path(spec)


def _installed_version(*names: str) -> str | None:
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return None


def requirements(flavour: Flavour, versions: Callable[..., str | None] = _installed_version) -> str:
    """The image's pinned dependencies: the versions this server runs.

    The server evaluates the model and merges the hosts' weights with these libraries,
    and pinned versions keep the image's dependency layer the same across boinc-dl
    releases. Only what the client app imports: TensorFlow (with Keras), NumPy, h5py.
    """
    tf = versions("tensorflow", "tensorflow-cpu", "tensorflow-intel", "tensorflow-macos")
    if tf is None:
        raise BoincProjectError("TensorFlow is not installed here: the Docker app versions pin the server's "
                                "TensorFlow (pip install 'boinc-dl[cpu]')")
    lines = [flavour.tensorflow.format(version=tf)]
    for dist in ("keras", "numpy", "h5py"):
        v = versions(dist)
        if v is None:
            raise BoincProjectError(f"{dist} is not installed here (pip install 'boinc-dl[cpu]')")
        lines.append(f"{dist}=={v}")
    return ("# boinc-dl's client app in its BOINC Docker app: pinned to the server's versions\n"
            + "\n".join(lines) + "\n")


def wheel_content_digest(data: bytes) -> str:
    """SHA-256 over a wheel's member names and contents, whatever its zip timestamps."""
    import io

    h = hashlib.sha256()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for info in sorted(z.infolist(), key=lambda i: i.filename):
            if info.is_dir():
                continue
            h.update(info.filename.encode() + b"\0")
            h.update(hashlib.sha256(z.read(info)).digest())
    return h.hexdigest()


def check_wheel(path: Path) -> str:
    """Check that ``path`` is a wheel of this very boinc-dl release; returns its file name."""
    if not path.is_file():
        raise BoincProjectError(f"--docker-wheel {path}: no such file")
    if not _WHEEL_NAME.fullmatch(path.name):
        raise BoincProjectError(f"--docker-wheel {path}: not a boinc-dl wheel name (boinc_dl-<version>-py3-none-any.whl)")
    try:
        with zipfile.ZipFile(path) as z:
            metas = [n for n in z.namelist() if re.fullmatch(r"boinc_dl-[^/]+\.dist-info/METADATA", n)]
            meta = z.read(metas[0]).decode("utf-8", "replace") if len(metas) == 1 else ""
    except (zipfile.BadZipFile, OSError) as e:
        raise BoincProjectError(f"--docker-wheel {path}: {e}") from None
    version = re.search(r"^Version: *(\S+)", meta, re.M)
    mine = _installed_version("boinc-dl")
    if version is None or (mine is not None and version.group(1) != mine):
        raise BoincProjectError(
            f"--docker-wheel {path}: boinc-dl {version.group(1) if version else '?'}, but the server runs "
            f"boinc-dl {mine}: hosts and server must run the same release")
    return path.name


def source_tree() -> Path | None:
    """The source tree of the installed boinc-dl (an editable install), or None."""
    import boinc_dl.server as srv

    for p in srv.__path__:
        root = Path(p).resolve().parent
        pyproject = root / "pyproject.toml"
        if pyproject.is_file() and re.search(r'^name *= *"boinc-dl"', pyproject.read_text(), re.M):
            return root
    return None


def build_wheel(out_dir: Path) -> Path:
    """``pip wheel --no-deps`` of the installed source tree, with fixed zip timestamps."""
    root = source_tree()
    if root is None:
        raise BoincProjectError("boinc-dl is not installed from a source tree: build its wheel "
                                "(pip wheel --no-deps .) and pass it with --docker-wheel")
    # from a clean copy: setuptools' build/ in the tree keeps files deleted since, and
    # would put them into the wheel
    src = out_dir / "src"
    src.mkdir()
    for entry in sorted(root.iterdir()):
        if entry.name in ("pyproject.toml", "setup.py", "setup.cfg", "server", "client_app") \
                or entry.name.startswith(("README", "LICENSE")):
            if entry.is_dir():
                shutil.copytree(entry, src / entry.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(entry, src / entry.name)
    env = dict(os.environ, SOURCE_DATE_EPOCH=os.environ.get("SOURCE_DATE_EPOCH", "315532800"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out_dir), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    wheels = sorted(out_dir.glob("boinc_dl-*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        raise BoincProjectError(f"building boinc-dl's wheel failed (exit {proc.returncode}): "
                                f"{(proc.stdout + proc.stderr).strip()[-800:]}")
    return wheels[0]


def _toml_str(s: str) -> str:
    if any(c in s for c in '"\\\n\r\t') or not s.isprintable():
        raise BoincProjectError(f"cannot write {s!r} into job.toml")
    return f'"{s}"'


def build_args(base_image: str, extra: list[str]) -> str:
    """job.toml's ``build_args``: the base image, then the admin's own arguments."""
    if not _IMAGE_REF.fullmatch(base_image):
        raise BoincProjectError(f"--docker-base-image {base_image!r}: not an image reference")
    for a in extra:
        if not _SHELL_INERT.fullmatch(a):
            raise BoincProjectError(f"--docker-build-arg {a!r}: docker_wrapper passes build arguments through a "
                                    f"shell; use letters, digits and _./:@=,+%- only")
    return " ".join(["--build-arg", f"BASE_IMAGE={base_image}", *extra])


def image_name(flavour: Flavour, parts: list[bytes]) -> str:
    """``bdl-<flavour>-<digest>``: lower case, no tag, not ``boinc__`` (see module docstring)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    digest = base64.b32encode(h.digest()).decode().lower()[:16]
    return f"bdl-{flavour.name}-{digest}"


def job_toml(version: str, flavour: Flavour, image: str, args: str) -> str:
    """docker_wrapper's configuration (``samples/docker_wrapper/docker_wrapper.cpp``)."""
    return (
        f"# boinc-dl {APP_NAME} {version}, Docker app version ({flavour.name}); read by BOINC's docker_wrapper.\n"
        "# The image is kept under image_name, so a host builds it once.\n"
        f"image_name = {_toml_str(image)}\n"
        f"workdir = {_toml_str(WORKDIR)}\n"
        f"project_dir_mount = {_toml_str(PROJECT_MOUNT)}\n"
        f"use_gpu = {'true' if flavour.use_gpu else 'false'}\n"
        f"build_args = {_toml_str(args)}\n"
    )


def version_xml(wrapper: str, files: list[tuple[str, str]]) -> str:
    """``version.xml``: docker_wrapper as main program, every other file copied into the slot."""
    root = ET.Element("version")
    f = ET.SubElement(root, "file")
    ET.SubElement(f, "physical_name").text = wrapper
    ET.SubElement(f, "main_program")
    for phys, logical in files:
        f = ET.SubElement(root, "file")
        ET.SubElement(f, "physical_name").text = phys
        ET.SubElement(f, "logical_name").text = logical
        ET.SubElement(f, "copy_file")
    ET.SubElement(root, "is_wrapper")
    ET.indent(root, "    ")
    return to_xml(root) + "\n"


def docker_plan_class(flavour: Flavour) -> ET.Element:
    """The plan class: ``<docker/>``, plus the NVIDIA GPU conditions of ``bdl_nvidia``."""
    if flavour.use_gpu:
        pc = gpu_plan_class(name=flavour.plan_class)
        pc.insert(1, ET.Element("docker"))
        return pc
    return simple("plan_class", [("name", flavour.plan_class), ("docker", None)])


def version_files(version: str, flavour: Flavour, platform: str, wrapper: Path, wheel_name: str,
                  wheel: bytes, reqs: str, args: str) -> dict[str, tuple[bytes, int]]:
    """Every file of one Docker app version directory: name -> (content, mode)."""
    df, entry = dockerfile(), entry_script()
    image = image_name(flavour, [df, entry, reqs.encode(), wheel_content_digest(wheel).encode(), args.encode()])
    suffix = ".exe" if wrapper.name.endswith(".exe") else ""
    main = f"bdl_docker_wrapper_{version}_{platform}{suffix}"
    phys = {
        DOCKERFILE: f"bdl_docker_{version}.Dockerfile",
        ENTRY: f"bdl_docker_main_{version}.sh",
        JOB_TOML: f"bdl_docker_{version}_{flavour.name}.toml",
        REQUIREMENTS: f"bdl_docker_{version}_{flavour.name}_requirements.txt",
        wheel_name: f"bdl_docker_{version}_{wheel_name}",
    }
    data = {
        DOCKERFILE: df, ENTRY: entry, JOB_TOML: job_toml(version, flavour, image, args).encode(),
        REQUIREMENTS: reqs.encode(), wheel_name: wheel,
    }
    files: dict[str, tuple[bytes, int]] = {main: (wrapper.read_bytes(), 0o755)}
    for logical, name in phys.items():
        files[name] = (data[logical], 0o644)
    files["version.xml"] = (version_xml(main, [(phys[k], k) for k in phys]).encode(), 0o644)
    return files


# ---- installing them -------------------------------------------------------------------------


class DockerVersions:
    """Adds the Docker app versions, their plan classes and platforms to a project."""

    def __init__(self, root: Path, apps_dir: Path, version: str, gpu: bool, opts: DockerOptions, sink: Sink):
        self.root, self.apps_dir, self.version, self.gpu, self.o, self.sink = root, apps_dir, version, gpu, opts, sink

    @property
    def flavours(self) -> list[Flavour]:
        return [CPU, NVIDIA] if self.gpu else [CPU]

    def dirs(self) -> list[tuple[str, Flavour, Path]]:
        return [(plat, fl, self.apps_dir / APP_NAME / self.version / f"{plat}__{fl.plan_class}")
                for plat, _ in self.o.wrappers for fl in self.flavours]

    def _wheel(self, tmp: Path) -> tuple[str, bytes]:
        """The wheel's name and bytes: the ones already staged for this version if their
        content is the same (update_versions refuses a changed file under one name)."""
        path = self.o.wheel if self.o.wheel is not None else build_wheel(tmp)
        name = check_wheel(Path(path))
        data = Path(path).read_bytes()
        digest = wheel_content_digest(data)
        for _, _, d in self.dirs():
            old = d / f"bdl_docker_{self.version}_{name}"
            if old.is_file() and old.read_bytes() != data and wheel_content_digest(old.read_bytes()) == digest:
                return name, old.read_bytes()
        return name, data

    def app_versions(self) -> bool:
        """Write every missing version directory; True if any was written."""
        if not self.o.wrappers:
            return False
        plats = [p for p, _ in self.o.wrappers]
        if len(set(plats)) != len(plats):
            raise BoincProjectError(f"--docker-wrapper: one binary per platform ({', '.join(plats)})")
        for _, w in self.o.wrappers:
            if not w.is_file():
                raise BoincProjectError(f"--docker-wrapper {w}: no such file")
        args = build_args(self.o.base_image, self.o.build_args)
        with tempfile.TemporaryDirectory(prefix="bdl-wheel-") as tmp:
            wheel_name, wheel = self._wheel(Path(tmp))
        reqs = {fl.name: requirements(fl) for fl in self.flavours}
        wrappers = dict(self.o.wrappers)
        changed = False
        for plat, fl, d in self.dirs():
            files = version_files(self.version, fl, plat, wrappers[plat], wheel_name, wheel, reqs[fl.name], args)
            changed |= write_version_dir(self.sink, d, files, self.version)
        if changed:
            self.sink.note(
                "Docker app versions: a host builds the image on its first task (TensorFlow is downloaded from "
                f"the base image's package index; base image {self.o.base_image}) and keeps it; docs/boinc.md")
        return changed

    def plan_classes(self, plan_class_spec: Path) -> None:
        if not self.o.wrappers:
            return
        existed = plan_class_spec.exists()
        doc = XmlDoc.load(plan_class_spec, "plan_classes", create=True)
        for fl in self.flavours:
            done = upsert_named(doc, "plan_class", docker_plan_class(fl))
            if done:
                self.sink.change(f"plan_class_spec.xml: {done} plan class {fl.plan_class}")
        doc.save()
        if doc.changes and not existed:
            self.sink.note("plan_class_spec.xml is new: with it the scheduler no longer knows BOINC's built-in "
                           "plan classes; describe any other app's plan classes there too")

    def platforms(self, project_xml: Path) -> bool:
        """Add the Docker versions' platforms to project.xml (bin/xadd puts them in the database)."""
        if not self.o.wrappers:
            return False
        doc = XmlDoc.load(project_xml, "boinc", create=True)
        have = {child_text(pl, "name") for pl in doc.root.findall("platform")}
        for plat, _ in self.o.wrappers:
            if plat not in have:
                append_child(doc.root, simple("platform", [("name", plat),
                                                           ("user_friendly_name", PLATFORM_NAMES[plat])]), 0)
                doc.changes.append(f"platform {plat}")
        if doc.save():
            self.sink.change(f"project.xml: added {', '.join(doc.changes)}")
            return True
        return False


__all__ = ["CPU", "NVIDIA", "DockerOptions", "DockerVersions", "Flavour", "build_args", "docker_plan_class",
           "image_name", "job_toml", "platform_of", "requirements", "version_files", "wheel_content_digest"]
