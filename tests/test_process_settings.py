"""One settings model per process: the `omnikube stage|router` flags, the launcher's command lines and the
operator's container commands all come from `StageSettings` / `RouterSettings`, and each is parsed back
here with the real `omnikube` argument parser (`omni_runtime.cli.build_parser`).

No cluster: pods are rendered with the same resolve and build_* functions `omnikube render` and the
reconcile use.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_operator.builders.pipeline_objects import CONFIG_KEY
from omni_operator.builders.stage_workload import CONFIG_MOUNT
from omni_operator.render import render_pipeline
from omni_runtime.cli import build_parser
from omni_runtime.local.run import LocalRun
from omni_runtime.local.spec import LocalPipelineFile
from omni_runtime.registry import default_registry
from omni_runtime.router.settings import RouterSettings
from omni_runtime.settings import ProcessSettings
from omni_runtime.spec import ConnectorServer, ResolvedPipeline
from omni_runtime.stage.settings import StageSettings

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = default_registry()
TOPOLOGIES = sorted(p.stem for p in (ROOT / "config" / "pipelines").glob("*.yaml"))
SAMPLES = sorted((ROOT / "config" / "samples").glob("*.yaml"))


def parse(argv: list[str]) -> ProcessSettings:
    """Parse an `omnikube ...` command line as the process would, into its settings."""
    args = build_parser().parse_args(argv)
    model = {"stage": StageSettings, "router": RouterSettings}[args.command]
    return model.from_args(args)


def subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


# --- the flags ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [StageSettings, RouterSettings], ids=lambda m: m.command)
def test_every_flag_is_a_field_and_every_field_a_flag_with_its_docstring_as_help(model) -> None:
    parser = subparser(model.command)
    flags = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    assert set(flags) == set(model.model_fields)
    for name, field in model.model_fields.items():
        assert flags[name].option_strings[0] == "--" + name.replace("_", "-")
        first_words = field.description.split()[:4]
        assert " ".join(first_words) in " ".join(flags[name].help.split()), name


def test_a_flag_out_of_its_bounds_is_refused_with_the_fields_own_message(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["stage", "--config", "c.json", "--stage", "dit", "--port", "70000"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--port" in err and "less than or equal to 65535" in err


def test_a_missing_required_flag_is_named(capsys) -> None:
    with pytest.raises(SystemExit):
        parse(["stage", "--config", "c.json", "--pipeline-key-file", "k"])
    assert "--stage" in capsys.readouterr().err


def test_defaults_are_the_models_defaults() -> None:
    parsed = parse(["stage", "--config", "c.json", "--pipeline-key-file", "k", "--stage", "dit"])
    assert parsed == StageSettings(config="c.json", pipeline_key_file="k", stage="dit")
    parsed = parse(["router", "--config", "c.json", "--pipeline-key-file", "k"])
    assert parsed == RouterSettings(config="c.json", pipeline_key_file="k")


@pytest.mark.parametrize(
    "settings",
    [
        StageSettings(
            config="/x/r.json",
            pipeline_key_file="/k",
            stage="dit",
            port=9100,
            http_port=9101,
            replica="r0",
            shm_pool_bytes=0,
        ),
        StageSettings(
            config="r.json", pipeline_key_file="k", stage="enhancer", advertise_host="10.1.2.3", connector_timeout=2.5
        ),
        RouterSettings(config="r.json", pipeline_key_file="k", port=8123, kubeconfig="/k", ping_timeout=3),
    ],
    ids=["stage", "stage-advertise", "router"],
)
def test_to_argv_parses_back_to_the_same_settings(settings: ProcessSettings) -> None:
    assert parse([settings.command, *settings.to_argv()]) == settings


def test_to_argv_leaves_defaults_to_the_process() -> None:
    settings = StageSettings(config="c", pipeline_key_file="k", stage="s")
    assert settings.to_argv() == ["--config", "c", "--pipeline-key-file", "k", "--stage", "s"]


# --- the launcher's command lines -----------------------------------------------------------------


def test_the_launchers_command_lines_parse_to_the_ports_it_probes(tmp_path: Path) -> None:
    spec = LocalPipelineFile(model=str(tmp_path), pipeline="prompt-enhanced-t2i", connectors={"default": "mooncake"})
    run = LocalRun.prepare(spec, run_dir=tmp_path / "run", replicas={"dit": 2})
    procs = run.processes()
    stages = [p for p in procs if p.name.startswith("stage ")]
    assert len(stages) == 3
    for proc in stages:
        assert proc.cmd[1:3] == ["-m", "omni_runtime.cli"]
        settings = parse(proc.cmd[3:])
        assert isinstance(settings, StageSettings)
        assert settings.config == str(run.config_path)
        assert (settings.port, settings.http_port) in run.stage_ports[settings.stage]
        assert proc.probe == f"http://{run.host}:{settings.http_port}/readyz"
        assert settings.advertise_host == run.host
    (router,) = [p for p in procs if p.name == "router"]
    settings = parse(router.cmd[3:])
    assert isinstance(settings, RouterSettings) and settings.port == run.router_port
    resolved = ResolvedPipeline.model_validate_json(run.config_path.read_text())
    assert resolved.mooncake_master_host == run.host  # where the launcher starts its master


# --- the operator's pods ---------------------------------------------------------------------------


def manifest(topology: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "omnikube.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "p", "namespace": "apps"},
        "spec": {"model": "some/model", "pipeline": topology, **spec},
    }


def manifests() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for topology in TOPOLOGIES:
        out.append((topology, manifest(topology)))
        if len(REGISTRY.get(topology).stages) > 1:
            out.append((f"{topology}-mooncake", manifest(topology, connectors={"default": "mooncake"})))
    for sample in SAMPLES:
        out.append((f"sample-{sample.stem}", yaml.safe_load(sample.read_text())))
    return out


def pod_commands(objects: list[dict[str, Any]]) -> list[tuple[dict, dict, ProcessSettings]]:
    """(deployment, container, settings parsed from its command) for every omnikube container."""
    found = []
    for obj in objects:
        if obj["kind"] != "Deployment":
            continue
        for container in obj["spec"]["template"]["spec"]["containers"]:
            if container["command"][0] == "omnikube":
                found.append((obj, container, parse(container["command"][1:])))
    return found


@pytest.mark.parametrize(("case", "manifest_"), manifests(), ids=[c for c, _ in manifests()])
def test_every_rendered_container_command_parses_to_the_intended_settings(case: str, manifest_: dict) -> None:
    objects = render_pipeline(manifest_, REGISTRY)
    name = manifest_["metadata"]["name"]
    namespace = manifest_["metadata"].get("namespace", "default")
    configmap = next(o for o in objects if o["kind"] == "ConfigMap")
    resolved = ResolvedPipeline.model_validate_json(configmap["data"][CONFIG_KEY])
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    commands = pod_commands(objects)
    stages_seen = set()
    for _deployment, container, settings in commands:
        env = {e["name"]: e for e in container["env"]}
        ports = {p["containerPort"] for p in container["ports"]}
        assert settings.config == f"{CONFIG_MOUNT}/{CONFIG_KEY}"
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert CONFIG_MOUNT in mounts
        if isinstance(settings, RouterSettings):
            assert settings.port in ports and settings.host == "0.0.0.0"
            continue
        assert isinstance(settings, StageSettings)
        assert settings.stage == container["name"]
        stages_seen.add(settings.stage)
        # The pod's own IP, from the downward API: what other pods reach its transfer engine at.
        assert settings.advertise_host == "$(POD_IP)"
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert {settings.port, settings.http_port} <= ports
        # The router finds this stage through its group's Service at the port the process binds.
        discovery = resolved.discovery[settings.stage]
        service = services[discovery.service]
        assert discovery.port == settings.port
        assert settings.port in {p["port"] for p in service["spec"]["ports"]}
        assert container["terminationMessagePath"] == settings.termination_log
    assert stages_seen == set(resolved.topology.stage_names())
    assert sum(isinstance(s, RouterSettings) for _, _, s in commands) == 1
    mooncake = [o for o in objects if o["metadata"]["name"] == f"{name}-mooncake"]
    if ConnectorServer.MOONCAKE in resolved.connector_servers():
        # One master per pipeline, found by its headless Service's DNS name; not on the router Service.
        mc = resolved.topology.connectors.mooncake
        assert resolved.mooncake_master_host == f"{name}-mooncake.{namespace}.svc"
        assert {o["kind"] for o in mooncake} == {"Deployment", "Service"}
        service = services[f"{name}-mooncake"]
        assert service["spec"]["clusterIP"] == "None"
        assert {p["port"] for p in service["spec"]["ports"]} == {mc.master_port, mc.metadata_port}
        (master,) = next(o for o in mooncake if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"]
        assert f"--rpc_port={mc.master_port}" in master["command"]
        assert f"--http_metadata_server_port={mc.metadata_port}" in master["command"]
        router_service = services[f"{name}-router"]
        assert {p["name"] for p in router_service["spec"]["ports"]} == {"http"}
    else:
        assert resolved.mooncake_master_host is None and not mooncake
    json.dumps(objects)  # plain data all the way down
