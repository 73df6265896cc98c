"""CI checks of infra/terraform: HCL parses, variables and outputs documented and used,
checkov passes, the cloud-init templates are valid cloud-config whose scripts pass
ShellCheck and do what they claim, and (where a provider mirror exists) terraform validate."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

hcl2 = pytest.importorskip("hcl2", reason="python-hcl2 is in the dev extra: pip install -e '.[dev]'")

REPO = Path(__file__).resolve().parents[2]
TF = REPO / "infra" / "terraform"
MODULES = ["aws/server", "aws/spot-fleet", "gcp/server", "gcp/spot-fleet"]
EXAMPLES = ["examples/aws", "examples/gcp"]
CLOUD_INIT = TF / "cloud-init"
TEMPLATE_VAR = re.compile(r"(?<!\$)\$\{([A-Za-z_]\w*)\}")


def _clean(v: object) -> object:
    """python-hcl2 8 keeps HCL's quotes on strings and keys and marks blocks: drop both."""
    if isinstance(v, dict):
        return {_clean(k): _clean(x) for k, x in v.items() if k != "__is_block__"}
    if isinstance(v, list):
        return [_clean(x) for x in v]
    if isinstance(v, str) and len(v) >= 2 and v[0] == v[-1] == '"':
        return json.loads(v) if "${" not in v else v[1:-1]
    return v


def parse(path: Path) -> dict:
    with path.open() as f:
        return _clean(hcl2.load(f))


def module_docs(mod: str) -> list[dict]:
    return [parse(p) for p in sorted((TF / mod).glob("*.tf"))]


def all_tf() -> list[Path]:
    return sorted(TF.rglob("*.tf"))


def test_every_tf_file_parses() -> None:
    files = all_tf()
    assert len(files) >= 20
    for p in files:
        parse(p)  # raises on a syntax error


@pytest.mark.parametrize("mod", MODULES + EXAMPLES)
def test_variables_typed_documented_and_used(mod: str) -> None:
    docs = module_docs(mod)
    variables = {name: body for d in docs for v in d.get("variable", []) for name, body in v.items()}
    assert variables, mod
    # Everything but the variable blocks themselves: where a variable can be used.
    text = "\n".join(
        re.sub(r'(?ms)^variable "[^"]+" \{.*?^\}', "", p.read_text()) for p in (TF / mod).glob("*.tf")
    )
    for name, body in variables.items():
        assert body.get("description", "").strip(), f"{mod}: variable {name} has no description"
        assert "type" in body, f"{mod}: variable {name} has no type"
        assert re.search(rf"\bvar\.{re.escape(name)}\b", text), f"{mod}: variable {name} is never used"


@pytest.mark.parametrize("mod", MODULES + EXAMPLES)
def test_outputs_documented(mod: str) -> None:
    outputs = {name: body for d in module_docs(mod) for o in d.get("output", []) for name, body in o.items()}
    assert outputs, f"{mod} has no outputs"
    for name, body in outputs.items():
        assert body.get("description", "").strip(), f"{mod}: output {name} has no description"


@pytest.mark.parametrize("mod", MODULES + EXAMPLES)
def test_versions_pinned(mod: str) -> None:
    blocks = [t for d in module_docs(mod) for t in d.get("terraform", [])]
    assert len(blocks) == 1, mod
    tf = blocks[0]
    assert re.search(r">=\s*1\.\d+.*<\s*2", tf["required_version"]), tf["required_version"]
    providers = {k: v for p in tf["required_providers"] for k, v in p.items()}
    text = "\n".join(p.read_text() for p in (TF / mod).glob("*.tf"))
    used = set(re.findall(r'^(?:resource|data) "([a-z]+)_', text, re.M))
    assert used <= set(providers), f"{mod}: providers used but not required: {used - set(providers)}"
    for name, spec in providers.items():
        assert spec["source"] == f"hashicorp/{name}"
        assert re.fullmatch(r">= \d+\.\d+\.\d+, < \d+\.0\.0", spec["version"]), (name, spec["version"])


def test_aws_fleet_matches_the_controller_contract() -> None:
    """Names and settings the fleet controller relies on (docs/fleet.md)."""
    main = (TF / "aws/spot-fleet/main.tf").read_text()
    asg = parse(TF / "aws/spot-fleet/main.tf")
    res = {(k, n): b for r in asg["resource"] for k, v in r.items() for n, b in v.items()}
    group = res[("aws_autoscaling_group", "this")]
    assert group["capacity_rebalance"] is True
    dist = group["mixed_instances_policy"][0]["instances_distribution"][0]
    assert dist["spot_allocation_strategy"] == "price-capacity-optimized"
    # The controller owns the size and the on-demand share: Terraform must not undo them.
    ignored = group["lifecycle"][0]["ignore_changes"]
    assert any("desired_capacity" in str(i) for i in ignored)
    assert any("on_demand_percentage_above_base_capacity" in str(i) for i in ignored)
    assert res[("aws_sqs_queue", "interruptions")]["name"] == "${var.name}-interruptions"
    assert res[("aws_sqs_queue", "interruptions")]["sqs_managed_sse_enabled"] is True
    assert "EC2 Spot Instance Interruption Warning" in main
    assert "EC2 Instance Rebalance Recommendation" in main
    lt = res[("aws_launch_template", "this")]
    assert lt["metadata_options"][0]["http_tokens"] == "required"
    assert lt["block_device_mappings"][0]["ebs"][0]["encrypted"] is True
    # Least privilege: the controller's permissions are the ones docs/fleet.md lists.
    for action in ("autoscaling:SetDesiredCapacity", "autoscaling:UpdateAutoScalingGroup",
                   "autoscaling:TerminateInstanceInAutoScalingGroup", "autoscaling:DescribeAutoScalingGroups",
                   "ec2:DescribeInstances", "ec2:DescribeSpotPriceHistory", "sqs:ReceiveMessage",
                   "sqs:DeleteMessage"):
        assert f'"{action}"' in main, action
    assert "resources = [aws_autoscaling_group.this.arn]" in main
    assert "resources = [aws_sqs_queue.interruptions.arn]" in main
    # The hosts read their one secret.
    assert "resources = [var.weak_key_secret_arn]" in main


def test_gcp_fleet_matches_the_controller_contract() -> None:
    doc = parse(TF / "gcp/spot-fleet/main.tf")
    res = {(k, n): b for r in doc["resource"] for k, v in r.items() for n, b in v.items()}
    sched = res[("google_compute_instance_template", "this")]["scheduling"][0]
    assert "SPOT" in (TF / "gcp/spot-fleet/main.tf").read_text()
    assert "instance_termination_action" in sched
    assert sched["automatic_restart"] is False
    mig = res[("google_compute_instance_group_manager", "this")]
    assert any("target_size" in str(i) for i in mig["lifecycle"][0]["ignore_changes"])
    perms = res[("google_project_iam_custom_role", "resize")]["permissions"]
    assert sorted(perms) == ["compute.instanceGroupManagers.get", "compute.instanceGroupManagers.update"]
    assert "condition" in res[("google_project_iam_member", "resize")]
    assert res[("google_secret_manager_secret_iam_member", "host")]["role"] == "roles/secretmanager.secretAccessor"
    server = parse(TF / "gcp/server/main.tf")
    sres = {(k, n): b for r in server["resource"] for k, v in r.items() for n, b in v.items()}
    cfg = sres[("google_compute_instance", "this")]["shielded_instance_config"][0]
    assert cfg["enable_secure_boot"] and cfg["enable_vtpm"] and cfg["enable_integrity_monitoring"]
    assert sres[("google_compute_firewall", "http")]["allow"][0]["ports"] == ["80", "443"]


# --- cloud-init ------------------------------------------------------------------------

def templatefile_calls() -> list[tuple[Path, str, set[str]]]:
    """(file, template name, keys passed) for every templatefile() call."""
    calls = []
    for p in all_tf():
        text = p.read_text()
        for m in re.finditer(r'templatefile\("\$\{path\.module\}/\.\./\.\./cloud-init/([\w.]+)", \{(.*?)\}\)', text, re.S):
            keys = set(re.findall(r"^\s*(\w+)\s*=", m.group(2), re.M))
            calls.append((p, m.group(1), keys))
    return calls


def render(name: str, **values: str) -> str:
    """Terraform's templatefile() for templates that use only ${var} (checked here)."""
    text = (CLOUD_INIT / name).read_text()
    assert "%{" not in text, "directives are not used: keep the templates plain"
    missing = set(TEMPLATE_VAR.findall(text)) - set(values)
    assert not missing, missing
    out = TEMPLATE_VAR.sub(lambda m: values[m.group(1)], text)
    return out.replace("$${", "${")


HOST_VALUES = {"cloud": "aws", "region": "us-east-1", "project_url": "http://203.0.113.7/boincdl/",
               "secret_id": "arn:aws:secretsmanager:us-east-1:123456789012:secret:bdl-weak-account-key-AbCdEf",
               "requirement": "boinc-dl[gpu]==0.1.0"}
SERVER_VALUES = {"cloud": "gcp", "region": "us-central1", "redis_secret_id": "projects/p/secrets/bdl-redis-password",
                 "source_repo": "https://example.org/boinc-dl.git", "source_ref": "v0.1.0",
                 "url_base": "http://203.0.113.7", "data_device": "/dev/disk/by-id/google-bdl-data"}


def test_templates_shared_and_called_with_exactly_their_variables() -> None:
    calls = templatefile_calls()
    by_template: dict[str, list[Path]] = {}
    for path, name, keys in calls:
        used = set(TEMPLATE_VAR.findall((CLOUD_INIT / name).read_text()))
        assert keys == used, f"{path}: {name} gets {sorted(keys)}, uses {sorted(used)}"
        by_template.setdefault(name, []).append(path.relative_to(TF))
    # One template per role, rendered by both clouds.
    assert sorted(map(str, by_template["host.yaml.tftpl"])) == ["aws/spot-fleet/main.tf", "gcp/spot-fleet/main.tf"]
    assert sorted(map(str, by_template["server.yaml.tftpl"])) == ["aws/server/main.tf", "gcp/server/main.tf"]


@pytest.mark.parametrize("name,values", [("host.yaml.tftpl", HOST_VALUES), ("server.yaml.tftpl", SERVER_VALUES)])
def test_cloud_config_valid(name: str, values: dict[str, str]) -> None:
    text = render(name, **values)
    assert text.startswith("#cloud-config\n")
    doc = yaml.safe_load(text)
    known = {"preserve_hostname", "package_update", "packages", "write_files", "runcmd"}
    assert set(doc) <= known, set(doc) - known
    for f in doc["write_files"]:
        assert set(f) <= {"path", "permissions", "content", "owner"}, f
        assert f["path"].startswith("/") and re.fullmatch(r"0[0-7]{3}", f["permissions"])
    assert all(isinstance(c, list) for c in doc["runcmd"])
    # Never a secret in user-data: only the secret's id.
    assert "get-secret-value" in text and "secretmanager.googleapis.com" in text


@pytest.mark.skipif(not shutil.which("shellcheck"), reason="shellcheck not installed (.ci/deps.sh installs it)")
@pytest.mark.parametrize("name,values", [("host.yaml.tftpl", HOST_VALUES), ("server.yaml.tftpl", SERVER_VALUES)])
def test_cloud_init_scripts_pass_shellcheck(tmp_path: Path, name: str, values: dict[str, str]) -> None:
    doc = yaml.safe_load(render(name, **values))
    scripts = [f for f in doc["write_files"] if f["content"].startswith("#!/bin/sh")]
    assert scripts
    paths = []
    for i, f in enumerate(scripts):
        p = tmp_path / f"script{i}.sh"
        p.write_text(f["content"])
        paths.append(str(p))
    runcmd = tmp_path / "runcmd.sh"
    runcmd.write_text("#!/bin/sh\n" + "".join(" ".join(c) + "\n" for c in doc["runcmd"]))
    for cmd in doc["runcmd"]:
        assert cmd[0] in {f["path"] for f in scripts}, cmd
    res = subprocess.run(["shellcheck", "-s", "sh", *paths, str(runcmd)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


def host_file(path: str) -> str:
    doc = yaml.safe_load(render("host.yaml.tftpl", **HOST_VALUES))
    return next(f["content"] for f in doc["write_files"] if f["path"] == path)


@pytest.mark.parametrize("url,expected", [
    # BOINC's escape_project_url(): drop the scheme, non [A-Za-z0-9._-] -> '_', one trailing '_' off.
    ("http://203.0.113.7/boincdl/", "203.0.113.7_boincdl"),
    ("https://boinc.example.org/bdl", "boinc.example.org_bdl"),
    ("http://host:8080/p_x//", "host_8080_p_x_"),
])
def test_account_file_name_is_boincs_escape(url: str, expected: str) -> None:
    script = host_file("/usr/local/sbin/bdl-host-setup")
    line = next(ln.strip() for ln in script.splitlines() if ln.strip().startswith("file=$("))
    res = subprocess.run(["sh", "-c", f'{line}\nprintf %s "$file"'], env={"BDL_PROJECT_URL": url, "PATH": os.environ["PATH"]},
                         capture_output=True, text=True, check=True)
    assert res.stdout == expected


def test_host_sets_hostname_before_attaching_and_venv_where_launcher_expects() -> None:
    script = host_file("/usr/local/sbin/bdl-host-setup")
    assert script.index("hostnamectl set-hostname") < script.index("account_$file.xml")
    assert "imds_aws instance-id" in script and "mds_gcp instance/name" in script
    launcher = next(REPO.glob("server/**/files/launcher.sh")).read_text()
    assert "/opt/boinc-dl/venv/bin/python3" in launcher
    assert "python3 -m venv /opt/boinc-dl/venv" in script
    unit = host_file("/etc/systemd/system/bdl-preempt-watch.service")
    assert "ExecStart=/opt/boinc-dl/venv/bin/python3 /opt/boinc-dl/bin/bdl-preempt-watch" in unit


def test_preempt_watch_service_reports_on_a_notice(tmp_path: Path) -> None:
    """The host watcher, run for real: a notice makes it stop work fetch and report now."""
    watch = tmp_path / "bdl-preempt-watch"
    watch.write_text(host_file("/opt/boinc-dl/bin/bdl-preempt-watch"))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "boinccmd.log"
    fake = bindir / "boinccmd"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    fake.chmod(0o755)
    notice = tmp_path / "notice"
    notice.write_text("spot reclaim\n")
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
           "BDL_PROJECT_URL": HOST_VALUES["project_url"], "BDL_PREEMPT_PROVIDER": "none",
           "BDL_PREEMPT_NOTICE_FILE": str(notice)}
    res = subprocess.run([sys.executable, str(watch)], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    url = HOST_VALUES["project_url"]
    assert log.read_text().splitlines() == [f"--project {url} nomorework", f"--project {url} update"]


# --- checkov and terraform validate ------------------------------------------------------

def checkov_binary() -> str | None:
    for cand in (os.environ.get("BDL_CHECKOV"), str(REPO / ".ci/checkov-venv/bin/checkov"), shutil.which("checkov")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


@pytest.mark.skipif(checkov_binary() is None,
                    reason="checkov not installed (.ci/run installs it into .ci/checkov-venv)")
def test_checkov_passes() -> None:
    text = "\n".join(p.read_text() for p in all_tf())
    for skip in re.findall(r"#checkov:skip=(.*)", text):
        check, _, why = skip.partition(":")
        assert re.fullmatch(r"CKV2?_[A-Z]+_\d+", check) and len(why.strip()) > 20, skip
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE"}  # no guideline download (offline)
    res = subprocess.run([checkov_binary(), "-d", str(TF), "--quiet", "--compact", "--framework", "terraform"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-5000:]
    assert "Failed checks: 0" in res.stdout


MIRROR = Path(os.environ.get("BDL_TF_PLUGIN_MIRROR", "/opt/tf-plugins"))


def mirrored(provider: str) -> bool:
    return (MIRROR / "registry.terraform.io" / "hashicorp" / provider).is_dir()


@pytest.mark.skipif(not shutil.which("terraform"), reason="terraform not installed (no registry package ships it)")
@pytest.mark.parametrize("mod", ["aws/server", "aws/spot-fleet", "examples/aws", "gcp/server", "gcp/spot-fleet", "examples/gcp"])
def test_terraform_validate_offline(tmp_path: Path, mod: str) -> None:
    """init from the local mirror only, validate, fmt, and terraform test where a module has tests."""
    needed = {"aws"} if mod.startswith(("aws", "examples/aws")) else {"google", "random"}
    absent = sorted(p for p in needed if not mirrored(p))
    if absent:
        pytest.skip(f"providers {absent} not in the local mirror {MIRROR}: validate needs them offline")
    tree = tmp_path / "terraform"
    shutil.copytree(TF, tree)
    rc = tmp_path / "terraformrc"
    rc.write_text(f'provider_installation {{\n  filesystem_mirror {{\n    path = "{MIRROR}"\n  }}\n}}\n')
    env = {**os.environ, "TF_CLI_CONFIG_FILE": str(rc), "TF_DATA_DIR": str(tmp_path / "data"),
           "TF_IN_AUTOMATION": "1", "CHECKPOINT_DISABLE": "1"}
    cmds = [["init", "-backend=false", "-input=false", "-no-color"], ["validate", "-no-color"]]
    if (tree / mod / "tests").is_dir():
        cmds.append(["test", "-no-color"])  # *.tftest.hcl against mock providers
    for cmd in cmds:
        res = subprocess.run(["terraform", *cmd], cwd=tree / mod, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
    fmt = subprocess.run(["terraform", "fmt", "-check", "-recursive", str(tree)], capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stdout


def test_host_client_reports_finished_tasks_at_once(tmp_path: Path) -> None:
    """Our hosts' cc_config.xml asks the client to report every finished task at its next
    scheduler poll (client/cs_scheduler.cpp, find_project_with_overdue_results), written
    by the setup script (run for real here) before the client is started."""
    import xml.etree.ElementTree as ET

    script = host_file("/usr/local/sbin/bdl-host-setup")
    start = script.index('cat >"$dir/cc_config.xml"')
    end = script.index("\nCC\n", start) + len("\nCC\n")
    assert end < script.index("systemctl enable --now boinc-client")
    res = subprocess.run(["sh", "-c", script[start:end]], env={"dir": str(tmp_path), "PATH": os.environ["PATH"]},
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    root = ET.parse(tmp_path / "cc_config.xml").getroot()
    assert root.tag == "cc_config"
    assert root.findtext("options/report_results_immediately") == "1"
    assert root.findtext("options/max_file_xfers_per_project") == "4"  # BOINC's default: 2
    assert root.findtext("log_flags/sched_ops") == "1"
