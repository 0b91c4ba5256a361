"""The pipeline registry: built-in topologies, names and aliases, model -> pipeline resolution."""

from __future__ import annotations

import json
import os
import re
import socket
from collections import Counter
from pathlib import Path

import pytest
import yaml

from omni_runtime.registry import (
    ModelFilesNotFound,
    PipelineRegistry,
    RegistryError,
    builtin_pipelines_dir,
    default_registry,
    get_pipeline,
    load_pipeline_file,
    load_registry,
    loader,
    local_model_dir,
    read_model_signature,
    resolve_model_pipeline,
)
from omni_runtime.spec import SpecError, StageKind

REPO = Path(__file__).resolve().parent.parent
BUILTIN = {
    "qwen3-omni",
    "qwen2-5-omni",
    "qwen-image",
    "qwen-image-edit",
    "flux",
    "wan2-2-t2v",
    "wan2-2-i2v",
    "stable-diffusion-3",
    "text-chat",
    "prompt-enhanced-t2i",
    "z-image",
    "bagel",
    "glm-image",
}


def model_dir(tmp_path: Path, *, architectures: list[str] | None = None, class_name: str | None = None) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    if architectures is not None:
        (folder / "config.json").write_text(json.dumps({"architectures": architectures, "model_type": "x"}))
    if class_name is not None:
        (folder / "model_index.json").write_text(json.dumps({"_class_name": class_name, "vae": ["x", "y"]}))
    return folder


def write(folder: Path, name: str, data: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def one_stage(name: str, **fields: object) -> dict:
    return {"name": name, "stages": [{"name": "llm", "kind": "ar", "final_output": True}], **fields}


# --- built-in pipelines ----------------------------------------------------------------------------


def test_builtin_folder_is_the_source_checkouts() -> None:
    assert builtin_pipelines_dir() == REPO / "config" / "pipelines"


def test_installed_layout_is_preferred(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = tmp_path / "omni_runtime" / "_pipelines"
    wheel.mkdir(parents=True)
    monkeypatch.setattr(loader, "_CANDIDATES", (wheel, REPO / "config" / "pipelines"))
    assert builtin_pipelines_dir() == wheel
    monkeypatch.setattr(loader, "_CANDIDATES", (tmp_path / "a", tmp_path / "b"))
    with pytest.raises(RegistryError, match="built-in pipeline folder is missing; looked in .*a, .*b"):
        builtin_pipelines_dir()


def test_all_builtin_pipelines_load_and_validate() -> None:
    files = sorted(p.stem for p in (REPO / "config" / "pipelines").glob("*.yaml"))
    registry = load_registry()
    assert registry.names() == files
    assert BUILTIN <= set(files)
    for name in files:
        spec = registry.get(name)
        assert spec.name == name
        assert spec.description
        assert spec.topological_order()  # acyclic, every stage reachable in order
        assert any(s.final_output for s in spec.stages)


@pytest.mark.parametrize("name", ["qwen3-omni", "qwen2-5-omni"])
def test_omni_topologies(name: str) -> None:
    spec = get_pipeline(name)
    assert spec.topological_order() == ["thinker", "talker", "code2wav"]
    kinds = {s.name: s.kind for s in spec.stages}
    # the talkers run their own decode loop in torch (omni_runtime.engines.speech)
    assert kinds == {"thinker": StageKind.AR, "talker": StageKind.GENERATION, "code2wav": StageKind.GENERATION}
    finals = {s.name: s.output_modality.value for s in spec.stages if s.final_output}
    assert finals == {"thinker": "text", "code2wav": "audio"}
    processors = {(e.source, e.target): e.input_processor for e in spec.edges}
    assert processors == {
        ("thinker", "talker"): "thinker_to_talker",
        ("talker", "code2wav"): "talker_to_code2wav",
    }
    for s in spec.stages:
        assert s.engine_args.get("model_stage", s.name) == s.name
    if name == "qwen3-omni":  # talker and code2wav run on omni_runtime.engines.speech
        runners = {s.name: s.engine_args.get("runner") for s in spec.stages}
        assert runners == {"thinker": None, "talker": "qwen3_omni_talker", "code2wav": "qwen3_omni_code2wav"}
    else:  # qwen2.5: the talker reads the thinker's embeddings and last-layer rows of every token
        runners = {s.name: s.engine_args.get("runner") for s in spec.stages}
        assert runners == {"thinker": None, "talker": "qwen2_5_omni_talker", "code2wav": "qwen2_5_omni_token2wav"}
        assert spec.stage("thinker").engine_args["hidden_state_layers"] == [0, -1]


def test_qwen3_omni_streams_codec_chunks_to_code2wav() -> None:
    spec = get_pipeline("qwen3-omni")
    assert spec.match.architectures == ["Qwen3OmniMoeForConditionalGeneration"]
    talker_to_code2wav = spec.downstream("talker")[0]
    assert talker_to_code2wav.window > 0
    assert spec.stage("thinker").engine_args["model_arch"] == "Qwen3OmniMoeForConditionalGeneration"


def test_qwen2_5_omni_matches_its_architecture() -> None:
    assert get_pipeline("qwen2-5-omni").match.architectures == ["Qwen2_5OmniForConditionalGeneration"]


@pytest.mark.parametrize(
    ("name", "diffusers_class", "modality"),
    [
        ("qwen-image", "QwenImagePipeline", "image"),
        ("qwen-image-edit", "QwenImageEditPipeline", "image"),
        ("flux", "FluxPipeline", "image"),
        ("wan2-2-t2v", "WanPipeline", "video"),
        ("wan2-2-i2v", "WanImageToVideoPipeline", "video"),
        ("stable-diffusion-3", "StableDiffusion3Pipeline", "image"),
        ("z-image", "ZImagePipeline", "image"),
    ],
)
def test_single_stage_diffusion_pipelines(name: str, diffusers_class: str, modality: str) -> None:
    spec = get_pipeline(name)
    assert spec.stage_names() == ["dit"] and spec.edges == []
    dit = spec.stage("dit")
    assert (dit.kind, dit.output_modality.value, dit.final_output) == (StageKind.DIFFUSION, modality, True)
    assert spec.match.diffusers_classes == [diffusers_class] and spec.match.architectures == []


def test_text_chat() -> None:
    spec = get_pipeline("text-chat")
    llm = spec.stage("llm")
    assert spec.stage_names() == ["llm"]
    assert (llm.kind, llm.output_modality.value, llm.final_output) == (StageKind.AR, "text", True)
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"):
        assert arch in spec.match.architectures


def test_prompt_enhanced_t2i() -> None:
    spec = get_pipeline("prompt-enhanced-t2i")
    assert spec.topological_order() == ["enhancer", "dit"]
    enhancer, dit = spec.stage("enhancer"), spec.stage("dit")
    assert enhancer.kind is StageKind.AR and not enhancer.final_output
    assert [c.role for c in enhancer.companions] == ["cfg_text"] and enhancer.companions[0].negative_prompt
    assert (dit.kind, dit.output_modality.value, dit.final_output) == (StageKind.DIFFUSION, "image", True)
    assert spec.edges[0].input_processor == "ar_text_to_prompt"
    assert spec.match.architectures == [] and spec.match.diffusers_classes == []


def test_no_model_matches_two_builtin_pipelines() -> None:
    registry = default_registry()
    keys = Counter()
    for spec in registry:
        keys.update(("arch", a) for a in set(spec.match.architectures))
        keys.update(("class", c) for c in set(spec.match.diffusers_classes))
    assert keys and all(count == 1 for count in keys.values()), keys


# --- names and aliases -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("typed", "name"),
    [
        ("qwen2.5-omni", "qwen2-5-omni"),
        ("qwen2-5-omni", "qwen2-5-omni"),
        ("wan2.2-t2v", "wan2-2-t2v"),
        ("Qwen2.5-Omni", "qwen2-5-omni"),
        (" flux ", "flux"),
        ("Z-Image-Turbo", "z-image"),
    ],
)
def test_names_and_aliases(typed: str, name: str) -> None:
    assert get_pipeline(typed).name == name
    assert typed in default_registry()


def test_aliases_listing() -> None:
    assert default_registry().aliases() == {
        "qwen2.5-omni": "qwen2-5-omni",
        "wan2.2-t2v": "wan2-2-t2v",
        "wan2.2-i2v": "wan2-2-i2v",
        "sd3": "stable-diffusion-3",
        "sd3-img2img": "stable-diffusion-3-img2img",
        "z-image-turbo": "z-image",
    }


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(RegistryError) as info:
        get_pipeline("qwen4-omni")
    message = str(info.value)
    assert message.startswith("pipeline 'qwen4-omni' is unknown; known pipelines are ['bagel', 'flux', ")
    for name in BUILTIN:
        assert repr(name) in message
    assert "qwen2.5-omni -> qwen2-5-omni" in message
    assert isinstance(info.value, SpecError)


# --- model -> pipeline -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("architectures", "pipeline"),
    [
        (["Qwen2ForCausalLM"], "text-chat"),
        (["LlamaForCausalLM"], "text-chat"),
        (["Qwen3OmniMoeForConditionalGeneration"], "qwen3-omni"),
        (["Qwen2_5OmniForConditionalGeneration"], "qwen2-5-omni"),
        (["BagelForConditionalGeneration"], "bagel"),
    ],
)
def test_resolve_from_config_json(tmp_path: Path, architectures: list[str], pipeline: str) -> None:
    assert resolve_model_pipeline(model_dir(tmp_path, architectures=architectures)).name == pipeline


@pytest.mark.parametrize(
    ("class_name", "pipeline"),
    [
        ("FluxPipeline", "flux"),
        ("QwenImagePipeline", "qwen-image"),
        ("QwenImageEditPipeline", "qwen-image-edit"),
        ("WanPipeline", "wan2-2-t2v"),
        ("WanImageToVideoPipeline", "wan2-2-i2v"),
        ("StableDiffusion3Pipeline", "stable-diffusion-3"),
        ("ZImagePipeline", "z-image"),
        ("GlmImagePipeline", "glm-image"),
    ],
)
def test_resolve_from_model_index_json(tmp_path: Path, class_name: str, pipeline: str) -> None:
    assert resolve_model_pipeline(str(model_dir(tmp_path, class_name=class_name))).name == pipeline


def test_unknown_architecture_lists_what_was_found_and_the_pipelines(tmp_path: Path) -> None:
    folder = model_dir(tmp_path, architectures=["BertModel"])
    with pytest.raises(RegistryError) as info:
        resolve_model_pipeline(folder)
    message = str(info.value)
    assert f"no pipeline matches the model at {folder}: it has config.json architectures ['BertModel']" in message
    assert "qwen3-omni (architectures Qwen3OmniMoeForConditionalGeneration)" in message
    assert "flux (diffusers FluxPipeline)" in message
    assert "prompt-enhanced-t2i (by name only)" in message
    assert "Set pipeline to one of them" in message


def test_unknown_diffusers_class_says_so(tmp_path: Path) -> None:
    with pytest.raises(RegistryError, match=re.escape("model_index.json _class_name 'StableDiffusionPipeline'")):
        resolve_model_pipeline(model_dir(tmp_path, class_name="StableDiffusionPipeline"))


def test_config_without_architectures(tmp_path: Path) -> None:
    with pytest.raises(RegistryError, match=re.escape("config.json architectures []")):
        resolve_model_pipeline(model_dir(tmp_path, architectures=[]))


def test_missing_folder_names_the_files_looked_for(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ModelFilesNotFound) as info:
        resolve_model_pipeline(missing)
    assert f"model folder {missing} does not exist; looked for {missing / 'config.json'}" in str(info.value)
    assert str(missing / "model_index.json") in str(info.value)
    assert isinstance(info.value, RegistryError)


def test_folder_without_either_file_names_both(tmp_path: Path) -> None:
    folder = model_dir(tmp_path)
    with pytest.raises(
        ModelFilesNotFound,
        match=re.escape(
            f"model folder {folder} has neither file; looked for "
            f"{folder / 'config.json'} (transformers) or "
            f"{folder / 'model_index.json'} (diffusers)"
        ),
    ):
        resolve_model_pipeline(folder)


@pytest.mark.parametrize(
    ("file", "content", "message"),
    [
        ("config.json", "{not json", "config.json: not valid JSON"),
        (
            "config.json",
            '{"architectures": "LlamaForCausalLM"}',
            "architectures: expected a list of class names",
        ),
        ("model_index.json", "[1, 2]", "model_index.json: expected a JSON object, found list"),
        ("model_index.json", '{"_class_name": 3}', "_class_name: expected a class name, found 3"),
    ],
)
def test_broken_model_files_are_named(tmp_path: Path, file: str, content: str, message: str) -> None:
    folder = model_dir(tmp_path)
    (folder / file).write_text(content)
    with pytest.raises(RegistryError, match=re.escape(message)):
        read_model_signature(folder)


def test_files_selecting_two_pipelines_are_ambiguous(tmp_path: Path) -> None:
    folder = model_dir(tmp_path, architectures=["Qwen2ForCausalLM"], class_name="FluxPipeline")
    with pytest.raises(RegistryError, match=re.escape("matches several pipelines ['flux', 'text-chat']")):
        resolve_model_pipeline(folder)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def test_resolution_uses_no_network(tmp_path: Path, no_network: None) -> None:
    cache = tmp_path / "cache"
    snapshot = cache / "models--Qwen--Qwen3-Omni-30B-A3B-Instruct" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"architectures": ["Qwen3OmniMoeForConditionalGeneration"]}))
    folder = local_model_dir("Qwen/Qwen3-Omni-30B-A3B-Instruct", cache)
    assert folder == snapshot
    registry = load_registry()  # fresh from disk, not the cached one
    assert registry.match(read_model_signature(folder)).name == "qwen3-omni"
    assert resolve_model_pipeline(folder).name == "qwen3-omni"
    with pytest.raises(ModelFilesNotFound):
        resolve_model_pipeline(local_model_dir("Org/Absent", cache))


# --- model references -> cache folders -------------------------------------------------------------


def hub_repo(cache: Path, repo_id: str, *commits: str, main: str | None = None) -> Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for i, commit in enumerate(commits):
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        os.utime(snap, (1_000_000 + i, 1_000_000 + i))
    if main:
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(main + "\n")
    return repo


def test_hub_id_uses_the_snapshot_refs_main_points_to(tmp_path: Path) -> None:
    repo = hub_repo(tmp_path, "Qwen/Qwen-Image", "old", "new", main="old")
    assert local_model_dir("Qwen/Qwen-Image", tmp_path) == repo / "snapshots" / "old"


def test_hub_id_without_refs_uses_the_newest_snapshot(tmp_path: Path) -> None:
    repo = hub_repo(tmp_path, "Qwen/Qwen-Image", "old", "new")
    assert local_model_dir("Qwen/Qwen-Image", tmp_path) == repo / "snapshots" / "new"


def test_hub_id_with_a_revision(tmp_path: Path) -> None:
    repo = hub_repo(tmp_path, "Qwen/Qwen-Image", "old", "new", main="new")
    assert local_model_dir("Qwen/Qwen-Image", tmp_path, revision="old") == repo / "snapshots" / "old"
    assert local_model_dir("Qwen/Qwen-Image", tmp_path, revision="gone") == Path("Qwen/Qwen-Image")


def test_hub_cache_under_hf_home(tmp_path: Path) -> None:
    repo = hub_repo(tmp_path / "hub", "Org/Name", "c1")
    assert local_model_dir("Org/Name", tmp_path) == repo / "snapshots" / "c1"


def test_plain_folder_in_the_cache(tmp_path: Path) -> None:
    (tmp_path / "Org" / "Name").mkdir(parents=True)
    assert local_model_dir("Org/Name", tmp_path) == tmp_path / "Org" / "Name"
    (tmp_path / "my-model").mkdir()
    assert local_model_dir("my-model", tmp_path) == tmp_path / "my-model"


@pytest.mark.parametrize("ref", ["/models/x", "./models/x", "Org/Absent"])
def test_other_references_are_paths(tmp_path: Path, ref: str) -> None:
    assert local_model_dir(ref, tmp_path) == Path(ref)
    assert local_model_dir(ref, None) == Path(ref)


# --- pipeline files --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad", "name: bad\nstages: [\n", "bad.yaml: not valid YAML"),
        ("bad", "- 1\n- 2\n", "bad.yaml: expected a mapping of PipelineSpec fields"),
        (
            "bad",
            {"name": "bad", "stages": [{"name": "llm", "kind": "rnn", "final_output": True}]},
            "bad.yaml: stages[0].kind: Input should be 'ar', 'diffusion' or 'generation' (got 'rnn')",
        ),
        (
            "bad",
            {"name": "bad", "stages": [{"name": "llm", "kind": "ar"}]},
            "bad.yaml: stages: no stage has final_output: true",
        ),
        (
            "bad",
            {
                "name": "bad",
                "stages": [{"name": "llm", "kind": "ar", "final_output": True}],
                "edges": [{"from": "llm", "to": "dit"}],
            },
            "bad.yaml: edges[0].to: no stage is named 'dit'",
        ),
        ("bad", {"name": "bad"}, "bad.yaml: stages: Field required"),
        ("bad", one_stage("other"), "bad.yaml: name: 'other' differs from the file name"),
        ("bad", one_stage("bad", aliases="x"), "bad.yaml: aliases: expected a list of names"),
        (
            "bad",
            one_stage("bad", aliases=["Bad Alias"]),
            "bad.yaml: aliases[0]: 'Bad Alias' is not a valid alias",
        ),
    ],
)
def test_invalid_files_name_the_file_and_field(tmp_path: Path, name: str, content: object, message: str) -> None:
    path = write(tmp_path, name, content)
    with pytest.raises(RegistryError, match=re.escape(message)) as info:
        load_pipeline_file(path)
    assert str(path) in str(info.value)
    with pytest.raises(RegistryError, match=re.escape(message)):
        load_registry([tmp_path])


def test_extra_folder_adds_pipelines(tmp_path: Path) -> None:
    write(
        tmp_path,
        "my-chat",
        one_stage("my-chat", aliases=["my.chat"], match={"architectures": ["GPT2LMHeadModel"]}),
    )
    registry = load_registry([tmp_path])
    assert registry.get("my.chat").name == "my-chat"
    assert BUILTIN <= set(registry.names())
    assert get_pipeline("my-chat", [tmp_path]).name == "my-chat"
    folder = model_dir(tmp_path, architectures=["GPT2LMHeadModel"])
    assert resolve_model_pipeline(folder, [tmp_path]).name == "my-chat"
    assert "my-chat" not in default_registry()


def test_extra_folder_replaces_a_builtin_of_the_same_name(tmp_path: Path) -> None:
    write(tmp_path, "text-chat", one_stage("text-chat", match={"architectures": ["LlamaForCausalLM"]}))
    registry = load_registry([tmp_path])
    assert registry.entry("text-chat").source == tmp_path / "text-chat.yaml"
    assert registry.get("text-chat").match.architectures == ["LlamaForCausalLM"]


def test_extra_pipeline_matching_a_builtin_model_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, "my-llama", one_stage("my-llama", match={"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(RegistryError) as info:
        load_registry([tmp_path])
    message = str(info.value)
    assert f"{path}: match: architecture 'LlamaForCausalLM' also selects pipeline 'text-chat'" in message
    assert str(REPO / "config" / "pipelines" / "text-chat.yaml") in message
    assert "a model would match two pipelines" in message


def test_alias_clashing_with_a_name_is_rejected(tmp_path: Path) -> None:
    write(tmp_path, "mine", one_stage("mine", aliases=["flux"]))
    with pytest.raises(
        RegistryError, match=re.escape("aliases: 'flux' is already the name or an alias of pipeline 'flux'")
    ):
        load_registry([tmp_path])
    write(tmp_path, "mine", one_stage("mine", aliases=["qwen2.5-omni"]))
    with pytest.raises(
        RegistryError,
        match=re.escape("'qwen2.5-omni' is already the name or an alias of pipeline 'qwen2-5-omni'"),
    ):
        load_registry([tmp_path])


def test_same_name_twice_in_one_folder_is_rejected(tmp_path: Path) -> None:
    write(tmp_path, "twin", one_stage("twin"))
    (tmp_path / "twin.yml").write_text(yaml.safe_dump(one_stage("twin")))
    with pytest.raises(RegistryError, match="pipeline 'twin' is also defined in"):
        load_registry([tmp_path], builtin=False)


def test_missing_extra_folder(tmp_path: Path) -> None:
    with pytest.raises(RegistryError, match=re.escape(f"pipeline folder {tmp_path / 'x'} does not exist")):
        load_registry([tmp_path / "x"])


def test_registry_without_builtins(tmp_path: Path) -> None:
    write(tmp_path, "solo", one_stage("solo"))
    registry = load_registry([tmp_path], builtin=False)
    assert registry.names() == ["solo"] and len(registry) == 1
    assert registry.items() == [("solo", registry.get("solo"))]
    assert [spec.name for spec in registry] == ["solo"]
    assert isinstance(registry, PipelineRegistry)
