"""The pipeline contract (spec.contract): what is in it and what is not, and the router keeping every request
within one generation of stage replicas.

The router cases run stage servers with the EchoEngine (tests/servelib.py says why) behind the real router app,
three generations of one two-stage pipeline (`a -> b`) discovered by the same router, as during a rollout: B
changes the edge's window (both stages' contract), C an engine arg of `b`'s own (only `b`'s).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
from servelib import EchoEngine, echo_pipeline, until, windowed_topology

from omni_runtime.registry import get_pipeline
from omni_runtime.spec import ENGINE_ARGS_MODELS, EdgeOverride, StageOverride, resolve_pipeline
from omni_runtime.spec.contract import model_identity, pipeline_contract, stage_digests
from omni_runtime.spec.engine_args import classified_fields
from omni_runtime.wire import protocol as P

RUNTIME = {"wire": 2}


def resolved(topology: str = "qwen3-omni", model: str = "/models/m", **overrides):
    stages = [StageOverride(name=k, engine_args=v) for k, v in overrides.pop("engine_args", {}).items()]
    stages += [StageOverride(name=k, sampling_params=v) for k, v in overrides.pop("sampling_params", {}).items()]
    return resolve_pipeline(get_pipeline(topology), name="p", model=model, stages=stages, **overrides)


def digests(pipeline) -> dict[str, str]:
    return stage_digests(pipeline_contract(pipeline), identity="", runtime=RUNTIME)


# -- what is in ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", sorted(set(ENGINE_ARGS_MODELS.values()), key=lambda m: m.__name__))
def test_every_engine_arg_is_either_in_the_contract_or_neutral(model) -> None:
    contract, neutral = classified_fields(model)
    assert not contract & neutral, f"{model.__name__}: in both: {contract & neutral}"
    unclassified = set(model.model_fields) - contract - neutral
    assert not unclassified, f"{model.__name__}: classify {unclassified} (contract_fields or neutral_fields)"
    assert not (contract | neutral) - set(model.model_fields), "a classified name that is no field"


def test_what_changes_no_payload_keeps_every_digest() -> None:
    base = digests(resolved())
    for same in (
        resolved(sampling_params={"thinker": {"temperature": 0.1}}),
        resolved(engine_args={"thinker": {"max_model_len": 512, "kv_cache_memory_bytes": 2**26}}),
        resolved(engine_args={"talker": {"max_requests": 3, "device": "cpu"}}),
        resolved(served_model_name="other"),
        resolved(engine_args={"thinker": {"context_format": "chat_template"}}),  # its default, given
    ):
        assert digests(same) == base


def test_a_payload_change_rolls_the_stages_that_send_or_read_it_and_no_other() -> None:
    base = digests(resolved())
    assert set(base) == {"thinker", "talker", "code2wav"} and len(set(base.values())) == 3

    def changed(pipeline) -> set[str]:
        now = digests(pipeline)
        return {s for s in base if now[s] != base[s]}

    everything = {"thinker", "talker", "code2wav"}
    assert changed(resolved(model="/models/other")) == everything
    # the thinker's hidden states: the thinker sends them, the talker reads them; code2wav reads codes only
    assert changed(resolved(engine_args={"thinker": {"media_hidden_layer": 1}})) == {"thinker", "talker"}
    assert changed(resolved(engine_args={"thinker": {"dtype": "float32"}})) == {"thinker", "talker"}  # vLLM's
    assert changed(resolved(engine_args={"code2wav": {"torch_dtype": "float32"}})) == {"code2wav"}
    window = [EdgeOverride(**{"from": "talker", "to": "code2wav", "window": 10})]
    assert changed(resolved(edges=window)) == {"talker", "code2wav"}


def test_the_spec_digest_is_the_operators_and_any_stage_change_changes_it() -> None:
    assert pipeline_contract(resolved()).digest == pipeline_contract(resolved()).digest
    assert pipeline_contract(resolved()).digest != pipeline_contract(resolved(model="/models/x")).digest
    bagel = pipeline_contract(resolved("bagel"))
    assert bagel.stages["dit"].reads_from["thinker"]["engine_args"]["export_kv_cache"] is True


def test_the_model_folders_identity_is_its_config_and_weights_index(tmp_path) -> None:
    a, b, c = (tmp_path / n for n in "abc")
    for folder, hidden in ((a, 8), (b, 8), (c, 16)):
        (folder / "talker").mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"hidden_size": hidden}))
        (folder / "talker" / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(bytes(hidden))  # the weights themselves are not read
    assert model_identity(a) == model_identity(b) != model_identity(c)
    (b / "talker" / "config.json").write_text('{"x": 1}')  # a component's config counts
    assert model_identity(a) != model_identity(b)
    assert model_identity(tmp_path / "missing") == ""
    one = resolved()
    assert stage_digests(pipeline_contract(one), identity=model_identity(a), runtime=RUNTIME) != stage_digests(
        pipeline_contract(one), identity=model_identity(c), runtime=RUNTIME
    )


# -- the router keeps a request within one generation -----------------------------------------------


def b_changed(topology):
    """`topology` with an engine arg of stage `b` changed that is in its contract (vLLM's dtype)."""
    changed = {"engine_args": {"dtype": "float32"}}
    stages = [s.model_copy(update=changed) if s.name == "b" else s for s in topology.stages]
    return topology.model_copy(update={"stages": stages})


class TwoGenerations:
    """Replicas of `a` and `b` of generations A (window 2), B (window 3) and C (A with `b`'s dtype float32)
    behind one router, which discovers A's at first."""

    async def start(self) -> TwoGenerations:
        import uvicorn

        from omni_runtime.router.app import build_app
        from omni_runtime.router.pool import StagePool
        from omni_runtime.spec import StageDiscovery
        from omni_runtime.stage.connectors import ConnectorSettings
        from omni_runtime.stage.server import StageServer
        from omni_runtime.wire.auth import PipelineKey

        key = PipelineKey.generate()
        self.pipelines = {
            "A": echo_pipeline(windowed_topology(window=2)),
            "B": echo_pipeline(windowed_topology(window=3)),
            "C": echo_pipeline(b_changed(windowed_topology(window=2))),
        }
        self.servers: dict[tuple[str, str], StageServer] = {}
        self.engines: dict[tuple[str, str], EchoEngine] = {}
        for gen, pipeline in self.pipelines.items():
            for stage in pipeline.topology.stages:
                engine = EchoEngine(pipeline, stage)
                server = StageServer(
                    pipeline, stage.name, key=key, engine=engine, port=0, http_port=None, replica=gen,
                    connectors=ConnectorSettings(owner=f"{stage.name}-{gen}", shm_pool_bytes=0),
                )  # fmt: skip
                await server.start()
                self.servers[gen, stage.name] = server
                self.engines[gen, stage.name] = engine
        router_pipeline = self.pipelines["A"].model_copy(deep=True)
        for stage in ("a", "b"):
            router_pipeline.discovery[stage] = StageDiscovery(static=[self.address("A", stage)])
        self.pool = StagePool(router_pipeline, key=key, ping_interval_s=0.05, ping_timeout_s=3.0)
        app = build_app(router_pipeline, self.pool)
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self._server.install_signal_handlers = lambda: None
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        await until(lambda: self._server.started and all(self.pool.ready().values()), timeout=10.0)
        return self

    def address(self, gen: str, stage: str) -> str:
        return f"127.0.0.1:{self.servers[gen, stage].port}"

    def discover(self, stage: str, *gens: str) -> None:
        """What an EndpointSlice update does: the router's replicas of `stage` are those of `gens`."""
        self.pool._update(stage, {self.address(g, stage) for g in gens})

    async def stop(self) -> None:
        self._server.should_exit = True
        await self._task
        self._sock.close()
        for server in self.servers.values():
            await server.stop()


@contextlib.asynccontextmanager
async def two_generations() -> AsyncIterator[TwoGenerations]:
    cluster = await TwoGenerations().start()
    try:
        yield cluster
    finally:
        await cluster.stop()


async def chat(cluster: TwoGenerations, text: str) -> httpx.Response:
    body = {"model": "echo", "messages": [{"role": "user", "content": text}]}
    async with httpx.AsyncClient(base_url=cluster.base, timeout=30) as http:
        reply = await http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply


def ran_on(cluster: TwoGenerations, text: str) -> set[tuple[str, str]]:
    return {
        key for key, engine in cluster.engines.items() if any(text in json.dumps(seen.data) for seen in engine.seen)
    }


@pytest.mark.timeout(60)
async def test_a_request_runs_within_the_newest_generation_whose_every_stage_is_ready() -> None:
    async with two_generations() as cluster:
        generation = {s: cluster.servers["A", s].contract for s in ("a", "b")}
        assert cluster.servers["A", "a"].contract != cluster.servers["B", "a"].contract  # the window differs
        reply = await chat(cluster, "first")
        assert json.loads(reply.headers["x-omnikube-contract"]) == generation
        assert ran_on(cluster, "first") == {("A", "a"), ("A", "b")}

        # B's `b` is up, B's `a` not yet: B is not whole, so requests stay on A, both stages
        cluster.discover("b", "A", "B")
        await until(lambda: len(cluster.pool["b"].usable()) == 2, timeout=10.0)
        for i in range(4):
            await chat(cluster, f"half{i}")
            assert ran_on(cluster, f"half{i}") == {("A", "a"), ("A", "b")}

        # B whole: new requests run on B alone, though A's replicas still serve
        cluster.discover("a", "A", "B")
        await until(lambda: len(cluster.pool["a"].usable()) == 2, timeout=10.0)
        for i in range(4):
            reply = await chat(cluster, f"whole{i}")
            assert ran_on(cluster, f"whole{i}") == {("B", "a"), ("B", "b")}
        assert json.loads(reply.headers["x-omnikube-contract"]) == {s: cluster.servers["B", s].contract for s in "ab"}

        # B's `b` goes (a rollback): B is not whole any more, requests run on A again
        cluster.discover("b", "A")
        await until(lambda: len(cluster.pool["b"].usable()) == 1, timeout=10.0)
        await chat(cluster, "back")
        assert ran_on(cluster, "back") == {("A", "a"), ("A", "b")}


@pytest.mark.timeout(60)
async def test_no_whole_generation_is_a_retriable_503_naming_what_each_lacks() -> None:
    async with two_generations() as cluster:
        cluster.pool.roll_wait_s = 0.2
        cluster.discover("a", "A")
        cluster.discover("b", "B")  # A's `a` and B's `b`: no generation has both
        await until(lambda: cluster.address("A", "b") not in cluster.pool["b"].replicas, timeout=10.0)
        await until(lambda: len(cluster.pool["b"].usable()) == 1, timeout=10.0)
        body = {"model": "echo", "messages": [{"role": "user", "content": "split"}]}
        async with httpx.AsyncClient(base_url=cluster.base, timeout=30) as http:
            reply = await http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 503, reply.text
        message = reply.json()["error"]["message"]
        assert "never runs across two generations" in message and "lacks ['b']" in message and "lacks ['a']" in message
        assert ran_on(cluster, "split") == set()


async def run_a_while(cluster: TwoGenerations, roll: Callable[[], Awaitable[None]]) -> httpx.Response:
    """A request whose `a` (of A) runs slowly (a second a word); once `a` has it, and before `b` has, `roll()`
    does what a rollout does to `b`. The router's reply."""
    body = {"model": "echo", "messages": [{"role": "user", "content": "w w w"}],
            "sampling_params_list": [{"delay": 1.0}, {}]}  # fmt: skip
    async with httpx.AsyncClient(base_url=cluster.base, timeout=30) as http:
        call = asyncio.create_task(http.post("/v1/chat/completions", json=body))
        await until(lambda: cluster.engines["A", "a"].seen, timeout=10.0)
        await roll()
        assert not any(cluster.engines[g, "b"].seen for g in "ABC"), "b started before the roll; make `a` slower"
        return await call


async def b_of(cluster: TwoGenerations, gen: str) -> None:
    """Discovery lists `gen`'s `b` beside A's, and the router has it up."""
    cluster.discover("b", "A", gen)
    await until(lambda: cluster.address(gen, "b") in {c.address for c in cluster.pool["b"].usable()}, timeout=10.0)


async def killed(cluster: TwoGenerations, gen: str, stage: str) -> None:
    """`gen`'s replica of `stage` dies (its process is gone; the router sees its connection drop)."""
    await cluster.servers[gen, stage].stop()
    address = cluster.address(gen, stage)
    await until(lambda: not cluster.pool[stage].replicas[address].finishing, timeout=10.0)


@pytest.mark.timeout(60)
async def test_a_request_finishes_in_its_generation_on_a_draining_replica_that_waits_for_it() -> None:
    """The operator deletes the old generation once the new one is ready: A's `b` drains (SIGTERM) while a
    request that began in A still runs `a`, and C (whose `a` is A's) is whole. The request still runs `b` on
    A's draining replica, which waits for it (the router's pings count it: `Ping.awaited`) and only then ends
    its drain."""
    async with two_generations() as cluster:
        drain: list[asyncio.Task] = []

        async def sigterm(server) -> bool:  # what `omnikube stage` does on SIGTERM
            try:
                return await server.drain(20)
            finally:
                await server.stop()

        async def roll() -> None:
            await b_of(cluster, "C")
            drain.append(asyncio.create_task(sigterm(cluster.servers["A", "b"])))
            await until(lambda: cluster.pool["b"].replicas[cluster.address("A", "b")].stage_draining, timeout=10.0)
            assert cluster.servers["A", "b"].awaited() == 1, "the router told the draining replica it awaits it"

        reply = await run_a_while(cluster, roll)
        assert reply.status_code == 200, reply.text
        assert ran_on(cluster, "w w") == {("A", "a"), ("A", "b")}
        assert json.loads(reply.headers["x-omnikube-contract"]) == {s: cluster.servers["A", s].contract for s in "ab"}
        assert await drain[0] is True, "the drain ended in time, once the request was done"
        assert cluster.pool.awaited("b", cluster.servers["A", "b"].contract) == 0
        await chat(cluster, "after")  # new requests run on C
        assert ran_on(cluster, "after") == {("A", "a"), ("C", "b")}


@pytest.mark.timeout(60)
async def test_a_request_whose_next_stage_lost_its_generation_goes_on_in_one_that_agrees_on_what_it_ran() -> None:
    """A's `b` is killed while a request that began in A runs `a`. C changes only `b`'s contract, so A and C
    agree on `a`: the request goes on with C's `b`, which reads what A's `a` sends. Both ends of every edge
    carry it in their digests (`spec.contract`), so this is no crossing."""
    async with two_generations() as cluster:
        assert cluster.servers["A", "a"].contract == cluster.servers["C", "a"].contract
        assert cluster.servers["A", "b"].contract != cluster.servers["C", "b"].contract

        async def roll() -> None:
            await b_of(cluster, "C")
            await killed(cluster, "A", "b")

        reply = await run_a_while(cluster, roll)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == "w w w "
        assert ran_on(cluster, "w w") == {("A", "a"), ("C", "b")}
        assert json.loads(reply.headers["x-omnikube-contract"]) == {
            "a": cluster.servers["A", "a"].contract,
            "b": cluster.servers["C", "b"].contract,
        }


@pytest.mark.timeout(60)
async def test_a_request_whose_next_stage_lost_its_generation_fails_when_none_agrees_on_what_it_ran() -> None:
    """B's `b` reads another window than A's `a` sends: the request that ran `a` of A has nowhere to go on once
    A's `b` is killed. It fails with a retriable 503 (after the router's roll wait), and B's `b` never sees it."""
    async with two_generations() as cluster:
        cluster.pool.roll_wait_s = 0.5

        async def roll() -> None:
            await b_of(cluster, "B")
            await killed(cluster, "A", "b")

        reply = await run_a_while(cluster, roll)
        assert reply.status_code == 503, reply.text
        assert "no ready replica of the pipeline generation this request runs in" in reply.json()["error"]["message"]
        assert ran_on(cluster, "w w") == {("A", "a")}


@pytest.mark.timeout(60)
async def test_a_stage_refuses_work_planned_for_another_generation_naming_both() -> None:
    """Defence in depth (the router never plans it): a Submit whose contract is not the replica's fails
    `unavailable` (a retriable 503 at the router) with both digests, and the engine never sees it."""
    async with two_generations() as cluster:
        replica = cluster.pool["a"].replicas[cluster.address("A", "a")]
        theirs, ours = cluster.servers["B", "a"].contract, cluster.servers["A", "a"].contract
        got: list[P.Message] = []
        submit = P.Submit(id="x.0.a.primary", request_id="x", stage="a", data=True, contract=theirs)
        replica.submit(submit, {"prompt": "crossed"}, lambda message, rest, lost: got.append(message))
        await until(lambda: got, timeout=10.0)
        (failed,) = got
        assert isinstance(failed, P.Failed) and failed.kind == "unavailable"
        assert theirs in failed.message and ours in failed.message
        assert ran_on(cluster, "crossed") == set()


# -- the operator labels each stage's pods with its part --------------------------------------------


def test_the_operator_labels_each_stages_pods_with_its_spec_digest_and_a_neutral_change_relabels_none() -> None:
    """`omnikube render` (the operator's builders): every stage pod template carries
    contract.omnikube.io/<stage> for each stage it runs, equal to what that stage reports (`Pong.spec_contract`,
    the same pure function over the same resolved config); a code2wav payload change relabels code2wav's
    pods only, a sampling change none."""
    from omni_operator.render import render_pipeline
    from omni_runtime.registry import default_registry

    def manifest(**code2wav) -> dict:
        return {
            "apiVersion": "omnikube.io/v1alpha1", "kind": "OmniPipeline", "metadata": {"name": "o"},
            "spec": {"model": "tiny-qwen3-omni", "pipeline": "qwen3-omni",
                     "stages": [{"name": "code2wav", **code2wav}]},
        }  # fmt: skip

    def pod_labels(m: dict) -> dict[str, dict[str, str]]:
        objects = render_pipeline(m, default_registry())
        return {
            o["metadata"]["ownerReferences"][0]["name"]: {
                k: v for k, v in o["spec"]["template"]["metadata"]["labels"].items() if k.startswith("contract.")
            }
            for o in objects
            if o["kind"] == "Deployment" and o["metadata"]["labels"]["app.kubernetes.io/component"] == "stage"
        }

    base = pod_labels(manifest())
    assert base == {
        f"o-{s}": {f"contract.omnikube.io/{s}": d}
        for s, d in {
            s: c.digest
            for s, c in pipeline_contract(
                resolve_pipeline(get_pipeline("qwen3-omni"), name="o", model="/models/tiny-qwen3-omni")
            ).stages.items()
        }.items()
    }
    assert pod_labels(manifest(samplingParams={"max_tokens": 9})) == base
    changed = pod_labels(manifest(engineArgs={"torch_dtype": "float32"}))
    assert [n for n in base if changed[n] != base[n]] == ["o-code2wav"]


# -- every spec field is classified ------------------------------------------------------------------


def _spec_paths() -> list[str]:
    """Every leaf field of the OmniPipeline spec, as `a.b[].c` (camelCase, as users write it)."""
    import typing

    from pydantic import BaseModel

    from omni_operator.api.omnipipeline import OmniPipelineSpec

    def models_in(annotation) -> list[type[BaseModel]]:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return [annotation]
        return [m for a in typing.get_args(annotation) for m in models_in(a)]

    def walk(model: type[BaseModel], prefix: str) -> list[str]:
        paths = []
        for name, info in model.model_fields.items():
            path = prefix + (info.alias or name) + ("[]" if "list[" in str(info.annotation) else "")
            inner = models_in(info.annotation)
            paths += [p for m in inner for p in walk(m, path + ".")] if inner else [path]
        return paths

    return walk(OmniPipelineSpec, "")


def test_every_spec_field_is_in_the_contract_or_out_of_it_and_the_crd_says_which() -> None:
    from omni_operator.api.contract_fields import BY_FOLDER, NEUTRAL, SPEC

    paths = _spec_paths()
    classified = [p for p in paths if p.startswith("router.")] + [p for p in paths if p in SPEC | BY_FOLDER | NEUTRAL]
    assert sorted(classified) == sorted(paths), f"classify {sorted(set(paths) - set(classified))}"
    assert not (SPEC & NEUTRAL or SPEC & BY_FOLDER or BY_FOLDER & NEUTRAL)
    assert (SPEC | BY_FOLDER | NEUTRAL) <= set(paths), "a listed path the spec lacks"
    from omni_operator.api.omnipipeline import OmniPipelineStatus

    docs = OmniPipelineStatus.model_fields["contract"].description or ""
    assert all(word in docs for word in ("model", "topology", "engine args", "connector", "window", "out of it"))


SPEC_CHANGES: dict[str, dict] = {
    "model": {"model": "tiny-qwen3-omni-b"},
    "pipeline": {"pipeline": "text-chat"},
    "runtime.modelCache.mountPath": {"runtime": {"modelCache": {"hostPath": {"path": "/c"}, "mountPath": "/m2"}}},
    "stages[].engineArgs": {"stages": [{"name": "thinker", "engineArgs": {"media_hidden_layer": 1}}]},
    "connectors.default": {"connectors": {"default": "mooncake"}},
    "connectors.mooncake.mode": {"connectors": {"default": "mooncake", "mooncake": {"mode": "store"}}},
    "connectors.mooncake.protocol": {"connectors": {"default": "mooncake", "mooncake": {"protocol": "rdma"}}},
    "connectors.edges[].from": {"connectors": {"edges": [{"from": "thinker", "to": "talker", "kind": "mooncake"}]}},
    "connectors.edges[].to": {"connectors": {"edges": [{"from": "talker", "to": "code2wav", "kind": "mooncake"}]}},
    "connectors.edges[].kind": {"connectors": {"edges": [{"from": "thinker", "to": "talker", "kind": "mooncake"}]}},
    "connectors.edges[].window": {"connectors": {"edges": [{"from": "talker", "to": "code2wav", "window": 10}]}},
    "connectors.edges[].firstWindow": {
        "connectors": {"edges": [{"from": "talker", "to": "code2wav", "firstWindow": 2}]}
    },
}
"""A change of each SPEC field from the base manifest below."""


def test_a_change_of_each_field_in_the_contract_changes_the_operators_digest_and_others_do_not() -> None:
    from omni_operator.api import OmniPipeline
    from omni_operator.api.contract_fields import SPEC
    from omni_operator.resolve import resolve_cluster_pipeline
    from omni_runtime.registry import default_registry

    def digest(**spec) -> str:
        manifest = {
            "apiVersion": "omnikube.io/v1alpha1", "kind": "OmniPipeline", "metadata": {"name": "o", "namespace": "n"},
            "spec": {"model": "tiny-qwen3-omni", "pipeline": "qwen3-omni", **spec},
        }  # fmt: skip
        return pipeline_contract(
            resolve_cluster_pipeline(OmniPipeline.model_validate(manifest), default_registry())
        ).digest

    assert set(SPEC_CHANGES) == SPEC
    base = digest()
    for path, change in SPEC_CHANGES.items():
        assert digest(**change) != base, path
    for change in (
        {"servedModelName": "x"},
        {"runtime": {"image": "other:1", "shmSize": "2Gi"}},
        {"stages": [{"name": "thinker", "replicas": 3, "samplingParams": {"temperature": 0.2}}]},
        {"connectors": {"startTimeoutSeconds": 30, "inlineMaxBytes": 1024}},
        {"router": {"replicas": 2, "limits": {"maxN": 2}}},
    ):
        assert digest(**change) == base, change
