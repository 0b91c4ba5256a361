"""The versioned KV payload (`omni_runtime.processors.kv_cache`): what a stage reading another stage's KV refuses.

No model: payloads are built from small arrays, the expectation from a config.json written here. A payload from a
checkpoint with another layer count, dtype or payload version is refused with a message naming both sides: what
keeps a rollout that mixes versions from guiding a DiT with garbage.
"""

from __future__ import annotations

import copy
import sys

import numpy as np
import pytest
import torch

from omni_runtime.processors.kv_cache import (
    KV_PAYLOAD_VERSION,
    KvPayloadMismatch,
    check_kv_payload,
    kv_expectation,
    kv_model_fingerprint,
    make_kv_payload,
)
from omni_runtime.processors.payloads import PAYLOAD_KINDS, KvCachePayload, downstream_only_keys

CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "transformers_version": "5.19.0",
    "dtype": "bfloat16",
}
BAGEL_LIKE = {"architectures": ["BagelForConditionalGeneration"], "llm_config": {**CONFIG, "num_hidden_layers": 28}}


def _payload(config: dict = CONFIG, dtype: torch.dtype = torch.bfloat16, tokens: int = 5) -> KvCachePayload:
    expected = kv_expectation(config, dtype=str(dtype).removeprefix("torch."))
    keys = torch.randn(tokens, expected.num_layers, expected.num_kv_heads, expected.head_dim).to(dtype)
    return make_kv_payload(keys, keys.clone(), model=expected.model, positions=range(tokens))


def test_a_payload_of_the_same_checkpoint_passes_and_says_what_it_holds() -> None:
    payload = _payload()
    check_kv_payload(payload, kv_expectation(CONFIG, dtype="bfloat16"), role="primary", edge="thinker->dit")
    assert (payload["kv_version"], payload["num_layers"], payload["num_kv_heads"], payload["head_dim"]) == (
        KV_PAYLOAD_VERSION, 2, 2, 32,
    )  # fmt: skip
    assert payload["dtype"] == "bfloat16" and payload["seq_len"] == 5
    assert payload["positions"] == [0, 1, 2, 3, 4] and payload["next_position"] == 5


@pytest.mark.parametrize(
    ("change", "producer", "consumer"),
    [
        ("layers", "2 layers, 2 KV heads x 32 (bfloat16, version 1)", "28 layers, 2 KV heads x 32 (bfloat16, "
         "version 1)"),
        ("dtype", "2 layers, 2 KV heads x 32 (bfloat16, version 1)", "2 layers, 2 KV heads x 32 (float32, version 1)"),
        ("version", "2 layers, 2 KV heads x 32 (bfloat16, version 2)", "2 layers, 2 KV heads x 32 (bfloat16, "
         "version 1)"),
    ],
)  # fmt: skip
def test_another_layer_count_dtype_or_version_is_refused_naming_both_sides(
    change: str, producer: str, consumer: str
) -> None:
    payload = _payload()
    expected = kv_expectation(CONFIG, dtype="bfloat16")
    if change == "layers":
        expected = kv_expectation(BAGEL_LIKE, dtype="bfloat16")
    elif change == "dtype":
        expected = kv_expectation(CONFIG, dtype="float32")
    else:
        payload["kv_version"] = 2
    with pytest.raises(KvPayloadMismatch) as err:
        check_kv_payload(payload, expected, role="cfg_text", edge="thinker->dit")
    assert str(err.value).startswith(
        f"edge thinker->dit, role cfg_text: payload from a checkpoint with {producer}, this stage expects {consumer}"
    )
    assert isinstance(err.value, ValueError)


def test_another_checkpoint_with_the_same_shapes_is_refused() -> None:
    """A config that differs in rope only: same shapes, and a KV that would guide silently wrong."""
    other = {**copy.deepcopy(CONFIG), "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
    with pytest.raises(KvPayloadMismatch, match=r"role cfg_img: payload from checkpoint 'Qwen2ForCausalLM/2L/2x32/"
                       r"bfloat16/\w+', this stage expects 'Qwen2ForCausalLM/2L/2x32/bfloat16/\w+'"):  # fmt: skip
        check_kv_payload(_payload(), kv_expectation(other, dtype="bfloat16"), role="cfg_img", edge="thinker->dit")


def test_arrays_that_disagree_with_their_own_header_are_refused() -> None:
    expected = kv_expectation(CONFIG, dtype="bfloat16")
    short = _payload()
    short["values"] = short["values"][:4]
    with pytest.raises(
        KvPayloadMismatch, match=r"header says \(5, 2, 2, 32\) bfloat16 .* its values are \(4, 2, 2, 32\)"
    ):
        check_kv_payload(short, expected, role="primary", edge="e")
    cast = _payload()
    cast["keys"] = cast["keys"].float()
    with pytest.raises(KvPayloadMismatch, match="its keys are .* float32"):
        check_kv_payload(cast, expected, role="primary", edge="e")
    positions = _payload()
    positions["positions"] = [0, 1]
    with pytest.raises(KvPayloadMismatch, match="2 positions for 5 tokens"):
        check_kv_payload(positions, expected, role="primary", edge="e")
    missing = dict(_payload())
    del missing["next_position"]
    with pytest.raises(KvPayloadMismatch, match=r"lacks \['next_position'\].*this stage reads version 1"):
        check_kv_payload(missing, expected, role="primary", edge="e")


def test_numpy_arrays_pass_as_connectors_hand_them_back() -> None:
    keys = np.zeros((3, 2, 2, 32), dtype=np.float32)
    payload = make_kv_payload(keys, keys, model=kv_expectation(CONFIG, dtype="float32").model, positions=[0, 1, 2])
    check_kv_payload(payload, kv_expectation(CONFIG, dtype="float32"), role="primary", edge="e")


def test_make_kv_payload_refuses_arrays_that_disagree() -> None:
    keys = torch.zeros(3, 2, 2, 32)
    with pytest.raises(ValueError, match="must share one shape"):
        make_kv_payload(keys, keys[:2], model="m", positions=[0, 1, 2])
    with pytest.raises(ValueError, match="one dtype"):
        make_kv_payload(keys, keys.to(torch.bfloat16), model="m", positions=[0, 1, 2])
    with pytest.raises(ValueError, match="2 positions for 3 KV tokens"):
        make_kv_payload(keys, keys, model="m", positions=[0, 1])


def test_the_fingerprint_follows_the_text_config_not_the_tool_that_saved_it() -> None:
    base = kv_model_fingerprint(CONFIG, dtype="bfloat16")
    assert base.startswith("Qwen2ForCausalLM/2L/2x32/bfloat16/")
    resaved = {**CONFIG, "transformers_version": "5.20.0", "dtype": "float32", "_name_or_path": "/elsewhere"}
    assert kv_model_fingerprint(resaved, dtype="bfloat16") == base
    assert kv_model_fingerprint({**CONFIG, "rms_norm_eps": 1e-5}, dtype="bfloat16") != base
    assert kv_model_fingerprint(CONFIG, dtype="float32") != base
    assert kv_model_fingerprint(BAGEL_LIKE, dtype="bfloat16").startswith("BagelForConditionalGeneration/28L/2x32/")
    omni = {"architectures": ["Qwen3OmniMoeForConditionalGeneration"], "thinker_config": {"text_config": CONFIG}}
    assert kv_expectation(omni, dtype="bfloat16").num_layers == 2
    with pytest.raises(KeyError, match="no 'num_hidden_layers'"):
        kv_expectation({"architectures": ["X"]}, dtype="bfloat16")


def test_the_payload_is_a_kind_whose_arrays_never_reach_a_client() -> None:
    assert KvCachePayload in PAYLOAD_KINDS
    assert {"kv_cache", "keys", "values"} <= set(downstream_only_keys())


def test_importing_the_payload_imports_no_torch() -> None:
    import subprocess

    code = (
        "import sys, omni_runtime.processors.kv_cache, omni_runtime.processors.payloads; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
