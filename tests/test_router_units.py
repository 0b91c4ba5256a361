"""Router parts without stages: balancer, admission, error mapping, request planning, inputs."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from omni_runtime.registry import get_pipeline
from omni_runtime.router.admission import Admission
from omni_runtime.router.balancer import ReplicaSet
from omni_runtime.router.errors import (
    BadRequest,
    ClientGone,
    EngineFailed,
    NotFound,
    Overloaded,
    RequestTimedOut,
    RequestTooLarge,
    StageLost,
    StageUnavailable,
    error_response,
    from_stage_failure,
)
from omni_runtime.router.plan import (
    companion_inputs,
    plan_request,
    producible_modalities,
    without_unweighted_companions,
)
from omni_runtime.router.protocol.chat import ChatMessage
from omni_runtime.router.protocol.images import parse_size
from omni_runtime.router.serving.inputs import entry_inputs, normalize_messages, stage_params


@dataclass
class FakeReplica:
    address: str
    outstanding: int = 0
    usable: bool = True

    def describe(self) -> str:
        return f"{self.address} {'up' if self.usable else 'down (connection lost)'}"


# -- balancer ------------------------------------------------------------------------------------


def test_balancer_picks_the_least_outstanding_usable_replica() -> None:
    replicas = ReplicaSet("llm")
    a, b, c = FakeReplica("a:1", 3), FakeReplica("b:1", 1), FakeReplica("c:1", 0, usable=False)
    replicas.replicas = {r.address: r for r in (a, b, c)}
    assert replicas.pick() is b
    b.outstanding = 5
    assert replicas.pick() is a
    assert replicas.pick(exclude=["a:1"]) is b


def test_balancer_rotates_between_equally_loaded_replicas() -> None:
    replicas = ReplicaSet("llm")
    replicas.replicas = {a: FakeReplica(a) for a in ("a:1", "b:1", "c:1")}
    picked = [replicas.pick().address for _ in range(6)]
    assert sorted(picked[:3]) == ["a:1", "b:1", "c:1"] and picked[:3] == picked[3:]


def test_balancer_without_usable_replicas_says_why() -> None:
    replicas = ReplicaSet("dit")
    with pytest.raises(StageUnavailable, match="no replicas"):
        replicas.pick()
    replicas.replicas = {"a:1": FakeReplica("a:1", usable=False)}
    with pytest.raises(StageUnavailable, match=r"stage 'dit' has no ready replica \(a:1 down \(connection lost\)\)"):
        replicas.pick()


# -- admission -----------------------------------------------------------------------------------


async def test_admission_admits_queues_then_refuses_with_retry_after() -> None:
    seen: list[tuple[int, int]] = []
    admission = Admission(2, 1, retry_after_s=3, on_change=lambda f, q: seen.append((f, q)))
    s1, s2 = await admission.acquire(), await admission.acquire()
    waiting = asyncio.create_task(admission.acquire())
    await asyncio.sleep(0)
    assert admission.in_flight == 2 and admission.queued == 1
    with pytest.raises(Overloaded) as err:
        await admission.acquire()
    assert err.value.status == 429 and err.value.headers == {"Retry-After": "3"}
    assert "2 requests in flight (limit 2) and 1 waiting (limit 1)" in err.value.message
    s1.release()
    s1.release()  # idempotent
    s3 = await asyncio.wait_for(waiting, 1)
    assert admission.in_flight == 2 and admission.queued == 0
    s2.release()
    s3.release()
    assert admission.in_flight == 0
    assert seen[-1] == (0, 0)


async def test_admission_is_fifo_and_a_cancelled_waiter_leaves_the_line() -> None:
    admission = Admission(1, 3)
    slot = await admission.acquire()
    order: list[str] = []

    async def wait(name: str) -> None:
        s = await admission.acquire()
        order.append(name)
        s.release()

    first = asyncio.create_task(wait("first"))
    gone = asyncio.create_task(wait("gone"))
    last = asyncio.create_task(wait("last"))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    assert admission.queued == 2
    slot.release()
    await asyncio.wait_for(asyncio.gather(first, last), 1)
    assert order == ["first", "last"]
    assert admission.in_flight == 0 and admission.queued == 0


# -- error mapping -------------------------------------------------------------------------------


def body(response) -> dict:
    return json.loads(response.body)


@pytest.mark.parametrize(
    ("error", "status", "type_"),
    [
        (BadRequest("bad", param="size"), 400, "BadRequestError"),
        (NotFound("The model `x` does not exist."), 404, "NotFoundError"),
        (RequestTooLarge("big"), 413, "RequestTooLargeError"),
        (Overloaded("full", retry_after=2), 429, "RateLimitError"),
        (ClientGone("gone"), 499, "ClientClosedRequest"),
        (EngineFailed("boom"), 500, "InternalServerError"),
        (StageLost("lost"), 502, "BadGatewayError"),
        (StageUnavailable("none"), 503, "ServiceUnavailableError"),
        (RequestTimedOut("slow"), 504, "TimeoutError"),
    ],
)
def test_router_errors_map_to_openai_error_bodies(error, status, type_) -> None:
    response = error_response(error)
    assert response.status_code == status
    assert body(response) == {"error": {"message": error.message, "type": type_, "param": error.param, "code": status}}
    if status in (429, 503):
        assert "retry-after" in response.headers


def test_stage_failure_kinds_map_to_4xx_or_5xx() -> None:
    assert isinstance(from_stage_failure("invalid_request", "m"), BadRequest)
    assert isinstance(from_stage_failure("unavailable", "m"), StageUnavailable)
    for kind in ("engine_error", "connector_error", "protocol_error"):
        assert from_stage_failure(kind, "m").status == 500


def test_validation_and_http_errors_map_to_openai_bodies() -> None:
    bad_json = RequestValidationError(
        [{"type": "json_invalid", "loc": ("body", 5), "msg": "JSON decode error", "ctx": {"error": "Expecting value"}}]
    )
    response = error_response(bad_json)
    assert response.status_code == 400
    assert body(response)["error"]["message"] == "the request body is not valid JSON: Expecting value"

    class M(BaseModel):
        n: int

    with pytest.raises(ValidationError) as err:
        M.model_validate({"n": "many"})
    response = error_response(err.value)
    assert response.status_code == 400 and body(response)["error"]["param"] == "n"
    assert "n: Input should be a valid integer" in body(response)["error"]["message"]

    response = error_response(HTTPException(404), ["/v1/chat/completions", "/v1/models"])
    assert response.status_code == 404
    assert body(response)["error"]["message"] == "no such route; this server offers /v1/chat/completions, /v1/models"
    response = error_response(json.JSONDecodeError("Expecting value", "{", 1))
    assert response.status_code == 400
    response = error_response(RuntimeError("surprise"))
    assert response.status_code == 500
    assert body(response)["error"] == {
        "message": "internal error: RuntimeError: surprise", "type": "InternalServerError", "param": None,
        "code": 500,
    }  # fmt: skip


# -- planning ------------------------------------------------------------------------------------

ROLES = ("primary", "cfg_text")


def test_plan_of_the_prompt_enhanced_pipeline_runs_the_companion() -> None:
    topology = get_pipeline("prompt-enhanced-t2i")
    assert producible_modalities(topology) == ["image"]
    plan = plan_request(topology, ["image"])
    assert plan.entry == ("enhancer",) and plan.final == ("dit",)
    enhancer, dit = plan.stages["enhancer"], plan.stages["dit"]
    assert enhancer.roles == ("primary", "cfg_text") and not enhancer.final
    assert [(e.target, e.connector, e.window) for e in enhancer.edges] == [("dit", "inline", 0)]
    assert dit.final and dit.upstream == ("enhancer",) and dit.input_processor == "ar_text_to_prompt"
    assert not dit.streamed_input


def test_plan_runs_only_what_the_modalities_need_and_streams_windowed_edges() -> None:
    topology = get_pipeline("qwen3-omni")
    assert producible_modalities(topology) == ["text", "audio"]
    text = plan_request(topology, ["text"])
    assert list(text.stages) == ["thinker"] and text.final == ("thinker",)
    assert text.stages["thinker"].edges == ()  # the talker does not run, so nothing is put for it
    both = plan_request(topology, ["text", "audio"])
    assert list(both.stages) == ["thinker", "talker", "code2wav"]
    assert both.final == ("thinker", "code2wav")
    assert both.stages["talker"].edges[0].window == 25 and both.stages["code2wav"].streamed_input
    assert both.stages["talker"].streamed_input  # thinker -> talker per step (window 1)
    assert both.stages["talker"].edges[0].first_window == 4


def test_companion_inputs_replace_the_last_user_message() -> None:
    topology = get_pipeline("prompt-enhanced-t2i")
    entry = {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "a cat"}]}
    default = companion_inputs(topology, "enhancer", entry, None, ROLES)["cfg_text"]
    assert default["messages"][0] == {"role": "system", "content": "sys"}
    assert default["messages"][1]["content"].startswith("blurry, low quality")
    assert companion_inputs(topology, "enhancer", entry, "dark", ROLES)["cfg_text"]["messages"][1]["content"] == "dark"
    assert entry["messages"][1]["content"] == "a cat"  # the primary's input is untouched
    assert companion_inputs(topology, "enhancer", {"prompt": "x"}, "neg", ROLES)["cfg_text"] == {"prompt": "neg"}


def test_bagel_images_run_the_thinker_for_its_context_only_and_a_chat_runs_it_alone() -> None:
    topology = get_pipeline("bagel")
    images = plan_request(topology, ["image"])
    thinker = images.stages["thinker"]
    assert thinker.roles == ("primary", "cfg_text") and thinker.context_only and not thinker.final
    assert images.stages["dit"].input_processor == "ar_kv_to_bagel" and images.final == ("dit",)
    chat = plan_request(topology, ["text"])  # understanding: the dit gets no work
    assert list(chat.stages) == ["thinker"] and not chat.stages["thinker"].context_only
    assert chat.stages["thinker"].roles == ("primary",)
    enhancer = plan_request(get_pipeline("prompt-enhanced-t2i"), ["image"]).stages["enhancer"]
    assert not enhancer.context_only  # its text is the dit's prompt: it must generate


def test_a_bagel_chat_answers_in_text_unless_it_asks_for_the_image_and_both_is_think_mode() -> None:
    from omni_runtime.router.plan import chat_modalities, context_drawn

    bagel = get_pipeline("bagel")
    assert context_drawn(bagel) == {"image": "thinker"}
    assert chat_modalities(bagel, None) == ["text"]  # understanding
    assert chat_modalities(bagel, ["image"]) == ["image"]
    both = plan_request(bagel, chat_modalities(bagel, ["text", "image"]))
    thinker = both.stages["thinker"]  # it answers (its plan) and prefills the context with it
    assert thinker.think and thinker.final and not thinker.context_only and both.final == ("thinker", "dit")
    assert thinker.roles == ("primary", "cfg_text")
    assert not plan_request(bagel, ["image"]).stages["thinker"].think
    omni = get_pipeline("qwen3-omni")  # speech is streamed from the thinker's text, not drawn from a context
    assert context_drawn(omni) == {} and chat_modalities(omni, None) == ["text", "audio"]


def test_a_bagel_edit_enters_at_the_dit_and_other_edits_at_their_entry_stages() -> None:
    from omni_runtime.router.plan import edit_entry, plan_edit

    bagel = get_pipeline("bagel")
    assert edit_entry(bagel) == "dit"  # it takes images and reads only a context from the thinker
    edit = plan_edit(bagel)
    assert list(edit.stages) == ["dit"] and edit.entry == edit.final == ("dit",)
    assert edit.stages["dit"].roles == ("primary",) and edit.stages["dit"].input_processor == "identity"
    for name in ("qwen-image-edit", "glm-image", "prompt-enhanced-t2i"):  # no context-only edge: the usual plan
        topology = get_pipeline(name)
        assert edit_entry(topology) is None and plan_edit(topology) == plan_request(topology, ["image"])


def test_a_companion_whose_guidance_is_one_is_not_planned() -> None:
    topology = get_pipeline("bagel")
    plan = plan_request(topology, ["image"])
    default = without_unweighted_companions(topology, plan, {"dit": {}})  # the dit's default cfg_text_scale is 4
    assert default.stages["thinker"].roles == ("primary", "cfg_text")
    off = without_unweighted_companions(topology, plan, {"dit": {"cfg_text_scale": 1}})
    assert off.stages["thinker"].roles == ("primary",)
    assert plan.stages["thinker"].roles == ("primary", "cfg_text")  # the shared plan is untouched
    # no guidance field: the prompt enhancer's companion always runs
    enhanced = get_pipeline("prompt-enhanced-t2i")
    eplan = plan_request(enhanced, ["image"])
    assert without_unweighted_companions(enhanced, eplan, {"dit": {"guidance_scale": 1}}) == eplan


def test_companion_inputs_drop_the_text_or_the_images() -> None:
    from omni_runtime.processors.companions import companion_input
    from omni_runtime.spec import CompanionSpec

    picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    entry = {
        "messages": [{"role": "user", "content": [picture, {"type": "text", "text": "make it red"}]}],
        "image": b"png",
        "negative_prompt": "dull",
    }
    text_free = companion_input(CompanionSpec(role="cfg_text", drops="text"), entry, None)
    assert text_free["messages"][0]["content"] == [picture, {"type": "text", "text": ""}]
    assert text_free["image"] == b"png" and "negative_prompt" not in text_free
    image_free = companion_input(CompanionSpec(role="cfg_img", drops="image"), entry, "ignored")
    assert image_free["messages"][0]["content"] == "make it red" and "image" not in image_free
    assert entry["messages"][0]["content"][0] is picture  # the primary's input is untouched


def test_companion_roles_must_be_distinct_and_not_primary() -> None:
    from omni_runtime.spec import StageSpec

    for roles in (["cfg_text", "cfg_text"], ["primary"]):
        with pytest.raises(ValidationError, match="must be distinct and never 'primary'"):
            StageSpec(name="a", kind="ar", companions=[{"role": r} for r in roles])


def test_stage_params_by_kind_and_choice() -> None:
    topology = get_pipeline("prompt-enhanced-t2i")
    plan = plan_request(topology, ["image"])
    params = stage_params(
        topology, plan, ar={"temperature": 0.5, "seed": 10, "top_p": None},
        image={"height": 64, "width": 128, "seed": 10, "guidance_scale": None}, choice=2,
    )  # fmt: skip
    assert params == {"enhancer": {"temperature": 0.5, "seed": 12}, "dit": {"height": 64, "width": 128, "seed": 12}}
    per_stage = stage_params(topology, plan, ar={}, image={}, per_stage=[{"max_tokens": 3}, {"num_inference_steps": 2}])
    assert per_stage == {"enhancer": {"max_tokens": 3}, "dit": {"num_inference_steps": 2}}
    with pytest.raises(BadRequest, match="sampling_params_list has 3 entries"):
        stage_params(topology, plan, ar={}, image={}, per_stage=[{}, {}, {}])


def test_entry_inputs_give_a_chat_to_ar_stages_and_a_prompt_to_others() -> None:
    messages = normalize_messages(
        [ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "cat"}])]
    )
    assert messages == [{"role": "user", "content": "a\ncat"}]
    t2i = get_pipeline("prompt-enhanced-t2i")
    assert entry_inputs(t2i, plan_request(t2i, ["image"]), messages=messages) == {"enhancer": {"messages": messages}}
    flux = get_pipeline("flux")
    assert entry_inputs(flux, plan_request(flux, ["image"]), messages=messages, negative_prompt="dark") == {
        "dit": {"prompt": "a\ncat", "negative_prompt": "dark"}
    }


def test_parse_size() -> None:
    assert parse_size("512x256") == (512, 256)
    assert parse_size(None) is None and parse_size("auto") is None
    for bad in ("512", "0x64", "axb", "64x64x3"):
        with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
            parse_size(bad)
