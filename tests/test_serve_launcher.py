"""`omnikube serve` preparation without starting processes: local pipeline files, model folders,
ports, discovery and connectors in the resolved JSON; and the stage pool following discovery."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
import yaml
import zmq.asyncio
from servelib import until

from omni_runtime.cli import build_parser
from omni_runtime.local.run import LocalRun
from omni_runtime.local.spec import load_local_spec
from omni_runtime.metrics import REGISTRY
from omni_runtime.router.client import ReplicaClient
from omni_runtime.router.discovery import KubernetesDiscovery, StaticDiscovery, make_discovery, ready_addresses
from omni_runtime.router.pool import StagePool
from omni_runtime.spec import ResolvedPipeline, SpecError, StageDiscovery
from omni_runtime.wire.auth import PipelineKey


def write(path, data) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture
def t2i_folder(tmp_path):
    """A folder shaped like tiny-prompt-enhanced-t2i (only what resolution reads)."""
    root = tmp_path / "t2i"
    (root / "enhancer").mkdir(parents=True)
    (root / "dit").mkdir()
    (root / "omnikube_pipeline.json").write_text(json.dumps({"pipeline": "prompt-enhanced-t2i"}))
    return root


def test_a_model_folder_selects_its_pipeline_from_the_marker(t2i_folder, tmp_path) -> None:
    spec = load_local_spec(t2i_folder)
    run = LocalRun.prepare(spec, run_dir=tmp_path / "run")
    resolved = ResolvedPipeline.model_validate_json((tmp_path / "run" / "resolved.json").read_text())
    assert resolved.topology.name == "prompt-enhanced-t2i" and resolved.name == "prompt-enhanced-t2i"
    assert resolved.model == str(t2i_folder.resolve())
    # local mode: the machine is one pod, so shm is the default and legal on every edge
    assert resolved.topology.connectors.default.value == "shm"
    assert resolved.stage_group("dit") == resolved.stage_group("enhancer")
    for stage in ("enhancer", "dit"):
        (address,) = resolved.discovery[stage].static
        assert address == f"127.0.0.1:{run.stage_ports[stage][0][0]}"
    ports = [p for pair in run.stage_ports.values() for p in pair[0]] + [run.router_port]
    assert len(set(ports)) == len(ports)
    assert run.endpoint == f"http://127.0.0.1:{run.router_port}/v1"


def test_a_pipeline_file_sets_replicas_overrides_edges_and_limits(t2i_folder, tmp_path) -> None:
    path = write(
        tmp_path / "p.yaml",
        {
            "model": "t2i",  # relative to the file
            "name": "demo",
            "served_model_name": "demo-model",
            "stages": [
                {"name": "enhancer", "replicas": 2, "sampling_params": {"max_tokens": 8}},
                # any engine arg: what is checked is that the file's stage overrides reach the resolved pipeline
                {"name": "dit", "engine_args": {"torch_dtype": "float32"}},
            ],
            "connectors": {
                "default": "inline",
                "edges": [{"from": "enhancer", "to": "dit", "connector": "mooncake", "window": 4, "first_window": 2}],
            },
            "limits": {"max_concurrent_requests": 3, "request_timeout_s": 9},
        },
    )
    run = LocalRun.prepare(load_local_spec(path), run_dir=tmp_path / "run", port=18123)
    resolved = run.resolved
    assert resolved.name == "demo" and resolved.served_model_name == "demo-model"
    assert resolved.model == str(t2i_folder.resolve())
    assert len(resolved.discovery["enhancer"].static) == 2 and len(resolved.discovery["dit"].static) == 1
    assert resolved.topology.stage("enhancer").sampling_params["max_tokens"] == 8
    assert resolved.topology.stage("enhancer").sampling_params["temperature"] == 0.7  # registry default kept
    assert resolved.topology.stage("dit").engine_args == {"torch_dtype": "float32"}
    edge = resolved.topology.edges[0]
    assert resolved.topology.edge_connector(edge).value == "mooncake"
    assert (edge.window, edge.first_window) == (4, 2)
    mc = resolved.topology.connectors.mooncake
    assert mc.master_port != 50051 and mc.metadata_port != 8080  # free ports, not the cluster defaults
    assert resolved.limits.max_concurrent_requests == 3 and resolved.limits.request_timeout_s == 9
    assert run.router_port == 18123
    commands = [p.cmd for p in run.processes()]
    assert sum("stage" in c for c in commands) == 3 and sum("router" in c for c in commands) == 1


def test_ports_are_distinct_and_below_the_kernels_ephemeral_range(t2i_folder, tmp_path) -> None:
    """The router binds minutes after its port was chosen (the stages load first): a port the kernel may
    give to an outgoing connection meanwhile made `omnikube serve` fail with "address already in use"."""
    from omni_runtime.local.run import _ephemeral_low

    path = write(tmp_path / "p.yaml", {"model": "t2i", "stages": [{"name": "enhancer", "replicas": 3}],
                                       "connectors": {"default": "mooncake"}})  # fmt: skip
    run = LocalRun.prepare(load_local_spec(path), run_dir=tmp_path / "run")
    mc = run.resolved.topology.connectors.mooncake
    stages = [port for pairs in run.stage_ports.values() for pair in pairs for port in pair]
    ports = [run.router_port, mc.master_port, mc.metadata_port, *stages]
    assert len(ports) == 2 * 4 + 3 and len(set(ports)) == len(ports), ports
    assert all(1024 <= p < _ephemeral_low() for p in ports), (ports, _ephemeral_low())


def test_each_run_gets_its_own_key_and_every_process_reads_it(t2i_folder, tmp_path) -> None:
    runs = [LocalRun.prepare(load_local_spec(t2i_folder), run_dir=tmp_path / f"run{i}") for i in range(2)]
    for run in runs:
        assert run.key_path.stat().st_mode & 0o777 == 0o600 and len(run.key_path.read_bytes()) == 32
        for proc in run.processes():
            i = proc.cmd.index("--pipeline-key-file")
            assert proc.cmd[i + 1] == str(run.key_path), proc.name
            args = build_parser().parse_args(proc.cmd[proc.cmd.index("omni_runtime.cli") + 1 :])
            assert args.pipeline_key_file == str(run.key_path)
    assert runs[0].key_path.read_bytes() != runs[1].key_path.read_bytes()


def test_serve_arguments_override_the_file(t2i_folder, tmp_path) -> None:
    args = build_parser().parse_args(
        ["serve", str(t2i_folder), "--connector", "inline", "--replicas", "dit=3", "--served-model-name", "x"]
    )
    assert args.func.__name__ == "_run_serve"
    run = LocalRun.prepare(
        load_local_spec(args.target),
        run_dir=tmp_path / "run",
        connector=args.connector,
        replicas={"dit": 3},
        served_model_name=args.served_model_name,
    )
    assert run.resolved.topology.connectors.default.value == "inline"
    assert len(run.resolved.discovery["dit"].static) == 3 and run.resolved.served_model_name == "x"


def test_serve_gives_the_router_the_api_key_file(t2i_folder, tmp_path) -> None:
    key = tmp_path / "key"
    key.write_text("local-secret\n")
    args = build_parser().parse_args(["serve", str(t2i_folder), "--api-key-file", str(key)])
    run = LocalRun.prepare(load_local_spec(args.target), run_dir=tmp_path / "run", api_key_file=args.api_key_file)
    (router,) = [p.cmd for p in run.processes() if p.name == "router"]
    parsed = build_parser().parse_args(router[router.index("router") :])
    assert parsed.api_key_file == str(key.resolve())
    (stage, *_) = [p.cmd for p in run.processes() if p.name != "router"]
    assert "--api-key-file" not in stage
    with pytest.raises(SpecError, match="--api-key-file: API key file .* is empty"):
        (tmp_path / "empty").write_text("\n")
        LocalRun.prepare(load_local_spec(t2i_folder), run_dir=tmp_path / "run2", api_key_file=tmp_path / "empty")


def test_bad_local_specs_say_what_to_change(t2i_folder, tmp_path) -> None:
    with pytest.raises(SpecError, match="neither a model folder nor a pipeline file"):
        load_local_spec(tmp_path / "missing")
    with pytest.raises(SpecError, match=r"stages\[0\]\.replicas"):
        load_local_spec(write(tmp_path / "a.yaml", {"model": "t2i", "stages": [{"name": "dit", "replicas": 0}]}))
    with pytest.raises(SpecError, match="model: field required|model: Field required"):
        load_local_spec(write(tmp_path / "b.yaml", {"pipeline": "flux"}))
    spec = load_local_spec(write(tmp_path / "c.yaml", {"model": "t2i", "stages": [{"name": "talker"}]}))
    with pytest.raises(SpecError, match="has no stage 'talker'; its stages are"):
        LocalRun.prepare(spec, run_dir=tmp_path / "run")
    with pytest.raises(SpecError, match="no stage 'nope'"):
        LocalRun.prepare(load_local_spec(t2i_folder), run_dir=tmp_path / "run2", replicas={"nope": 2})


def test_serve_refuses_an_engine_arg_its_engine_would_refuse_before_starting_anything(
    t2i_folder, tmp_path, capsys
) -> None:
    """`omnikube serve` with an omnikube engine arg of the wrong value exits 2 naming the stage and the key,
    and writes no run (no process started), as the operator reports it Degraded before any pod."""
    from omni_runtime.cli import main

    path = write(
        tmp_path / "p.yaml",
        {"model": str(t2i_folder), "stages": [{"name": "dit", "engine_args": {"quantization": "fp9"}}]},
    )
    run_dir = tmp_path / "run"
    assert main(["serve", path, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "stage 'dit': engine_args.quantization is 'fp9'" in err and "'fp8'" in err
    assert not (run_dir / "processes.json").exists()


# -- discovery -----------------------------------------------------------------------------------


def test_ready_addresses_of_endpoint_slices() -> None:
    slices = [
        {
            "ports": [{"name": "protocol", "port": 8100}, {"name": "http", "port": 8101}],
            "endpoints": [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                {"addresses": ["10.0.0.3"], "conditions": {}},  # unset means ready
                {"addresses": ["fd00::4"], "conditions": {"ready": True}},
            ],
        },
        {"ports": [{"port": 9000}], "endpoints": [{"addresses": ["10.0.1.1"], "conditions": {"ready": True}}]},
    ]
    assert ready_addresses(slices, 8100) == {"10.0.0.1:8100", "10.0.0.3:8100", "[fd00::4]:8100", "10.0.1.1:9000"}


def test_make_discovery_picks_static_or_kubernetes() -> None:
    assert isinstance(make_discovery(StageDiscovery(static=["a:1"]), "ns", None), StaticDiscovery)
    kube = make_discovery(StageDiscovery(service="p-dit"), "ns", api_client=object())
    assert isinstance(kube, KubernetesDiscovery)
    assert (kube.namespace, kube.service, kube.port, kube.selector) == (
        "ns", "p-dit", 8100, "kubernetes.io/service-name=p-dit",
    )  # fmt: skip
    with pytest.raises(ValueError, match="needs the Kubernetes API"):
        make_discovery(StageDiscovery(service="p-dit"), "ns", None)


class ListedDiscovery:
    """Discovery driven by the test: each `publish` is what an EndpointSlice watch would report."""

    def __init__(self) -> None:
        self.on_change = None

    async def run(self, on_change) -> None:
        self.on_change = on_change
        await asyncio.Event().wait()


def _replica_series(pipeline: str, address: str) -> dict[str, float | None]:
    labels = {"pipeline": pipeline, "stage": "dit", "replica": address}
    names = ("omnikube_stage_replica_up", "omnikube_stage_outstanding_requests")
    return {name: REGISTRY.get_sample_value(name, labels) for name in names}


async def test_a_replica_close_cancelled_midway_still_closes_its_sockets(t2i_folder, tmp_path) -> None:
    """The pool's reaper closes a replica discovery removed; when the router stops meanwhile, that close is
    cancelled while it waits for the replica's tasks. Its sockets close anyway: one left open blocked the router's
    shutdown for ever in the ZeroMQ context's term() (a cold-machine run of the next test hung 20 minutes there)."""
    run = LocalRun.prepare(load_local_spec(t2i_folder), run_dir=tmp_path / "run")
    ctx = zmq.asyncio.Context()
    client = ReplicaClient(ctx, run.resolved.name, "dit", "127.0.0.1:1", key=PipelineKey.from_file(run.key_path))
    client.start()
    closing = asyncio.create_task(client.close())
    await asyncio.sleep(0)  # close() now waits for the replica's cancelled tasks
    assert not closing.done()
    closing.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await closing
    assert client._sock.closed and client._monitor.closed, "a cancelled close left the replica's sockets open"
    ctx.term()  # returns at once: no socket of the context is left open


async def test_pool_follows_discovery_and_drains_removed_replicas(t2i_folder, tmp_path) -> None:
    """Discovery adds and removes replicas; a removed one drains, then goes, and so do its series on the
    router's /metrics (a gone pod IP exported forever would add a frozen series per pod ever seen).

    "Kept while its work runs" needs a pass of the pool's reaper to have looked at the busy replica: an
    idle replica removed together with it is reaped by such a pass, and a replica added only after that is
    reaped by a later one, so once both are gone a whole pass has gone by over the busy one."""
    run = LocalRun.prepare(load_local_spec(t2i_folder), run_dir=tmp_path / "run")
    name = run.resolved.name
    found = {"enhancer": ListedDiscovery(), "dit": ListedDiscovery()}
    pool = StagePool(run.resolved, key=PipelineKey.from_file(run.key_path), discoveries=found)
    await pool.start()
    try:
        await until(lambda: found["dit"].on_change is not None, "the pool did not start its discovery", timeout=15.0)
        found["dit"].on_change({"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"})
        assert sorted(pool["dit"].replicas) == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
        assert _replica_series(name, "127.0.0.1:2") == {
            "omnikube_stage_replica_up": 0.0, "omnikube_stage_outstanding_requests": 0.0,
        }  # fmt: skip
        client = pool["dit"].replicas["127.0.0.1:2"]
        client.outstanding = 1  # a work still runs there
        found["dit"].on_change({"127.0.0.1:1"})
        assert client.draining and not client.usable
        await until(lambda: "127.0.0.1:3" not in pool["dit"].replicas, "an idle removed replica was kept", timeout=15.0)
        found["dit"].on_change({"127.0.0.1:1", "127.0.0.1:4"})  # one more, listed after that reaper pass began
        found["dit"].on_change({"127.0.0.1:1"})  # and removed again at once
        await until(lambda: "127.0.0.1:4" not in pool["dit"].replicas, "the reaper stopped", timeout=15.0)
        assert "127.0.0.1:2" in pool["dit"].replicas and client.draining  # kept while its work runs
        client.outstanding = 0
        await until(lambda: "127.0.0.1:2" not in pool["dit"].replicas, "a drained replica was kept", timeout=15.0)
        assert sorted(pool["dit"].replicas) == ["127.0.0.1:1"]
        assert pool.ready() == {"enhancer": 0, "dit": 0}  # nothing answers on those ports
        for gone in ("127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4"):
            assert _replica_series(name, gone) == {
                "omnikube_stage_replica_up": None, "omnikube_stage_outstanding_requests": None,
            }, gone  # fmt: skip
        assert _replica_series(name, "127.0.0.1:1")["omnikube_stage_replica_up"] == 0.0  # still listed: kept
    finally:
        await pool.stop()
