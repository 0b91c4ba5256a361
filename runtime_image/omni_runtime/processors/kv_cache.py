"""A prompt's KV cache as it leaves an AR stage for a DiT that attends to it: the versioned `KvCachePayload`.

An `ar` stage with engine arg `export_kv_cache` puts one on the final piece of each request it runs, the
primary's and each CFG companion's (`ArOutput.kv_cache`; `engines.ar.kv_export` gets it out of vLLM). The
stage that reads it checks it first (`check_kv_payload`) against what its own checkpoint expects
(`kv_expectation`): a payload from another checkpoint, dtype or payload version is refused with a message
naming both sides, so a rollout that mixes versions fails loudly instead of guiding with garbage.

The payload is the KV of the prompt tokens only, every attention layer, as vLLM stores it: K after rope, in
the cache dtype, positions 0..n-1 unless `positions` says otherwise. `keys` and `values` are
(tokens, layers, kv_heads, head_dim), time first like every array on an edge.

**The model fingerprint** (`kv_model_fingerprint`) decides compatibility: the architecture, the layer count,
KV heads, head_dim, the dtype and a hash of the text model's config (config.json's `text_config` /
`llm_config` / `language_config`, or the whole file for a plain LLM, without the keys that change with the
tool that saved it). Why those: K/V are only meaningful to a reader whose attention was trained with the
same projections, rope (theta, scaling) and norms, all of which the text config fixes; the shapes make the
message readable; the dtype is the serving one, not the config's. Weights are not hashed (gigabytes, read
at every start): two fine-tunes with the same config share a fingerprint, so serve both stages from one
checkpoint.

Importing this module imports neither torch nor numpy (the wire and the router read the payload kinds).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypedDict

from omni_runtime.processors.markers import Array, DtypeKind, Layout, downstream_only

__all__ = [
    "BagelContexts",
    "KV_LAYOUT",
    "KV_PAYLOAD_VERSION",
    "TEXT_CONFIG_KEYS",
    "KvCachePayload",
    "KvExpectation",
    "KvPayloadMismatch",
    "check_kv_payload",
    "dtype_name",
    "kv_expectation",
    "kv_model_fingerprint",
    "make_kv_payload",
    "text_config",
]

KV_PAYLOAD_VERSION = 1
"""Bump when the payload's fields or their meaning change; a reader refuses another version."""

KV_LAYOUT = Layout((("tokens", "layers", "kv_heads", "head_dim"),), DtypeKind.FLOAT)

TEXT_CONFIG_KEYS = ("text_config", "llm_config", "language_config")
"""Where a multimodal config.json keeps its text model's config (first found wins; none: the whole file)."""

_VOLATILE_KEYS = frozenset(
    {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache", "_attn_implementation_autoset"}
)
"""Keys left out of the config hash: they change with the tool or machine that saved the checkpoint, or (dtype)
are stated on their own."""


class KvCachePayload(TypedDict):
    """One request's prompt KV cache, every attention layer (`engines.ar.kv_export`)."""

    kv_version: int
    """KV_PAYLOAD_VERSION of the producer."""
    model: str
    """The producing checkpoint's fingerprint (`kv_model_fingerprint`)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    """The cache dtype, as torch names it without `torch.` (`bfloat16`)."""
    seq_len: int
    """Tokens: the prompt's length."""
    positions: list[int]
    """The rope position of each token (0..seq_len-1 for a text model)."""
    next_position: int
    """The rope position of the token after the last one (where a reader's own tokens start)."""
    keys: Annotated[Array, KV_LAYOUT, downstream_only]
    """K after rope (tokens, layers, kv_heads, head_dim), in `dtype`."""
    values: Annotated[Array, KV_LAYOUT, downstream_only]
    """V (tokens, layers, kv_heads, head_dim), in `dtype`."""


class BagelContexts(TypedDict):
    """What `ar_kv_to_bagel` gives BAGEL's generation stage: each context's KV cache the thinker ran, by role
    (`primary`, and `cfg_text` / `cfg_img` for the CFG companions that ran)."""

    contexts: Annotated[dict[str, KvCachePayload], downstream_only]


@dataclass(frozen=True)
class KvExpectation:
    """What a stage accepts: the header fields a payload must have (`kv_expectation` builds it from config.json)."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_version: int = KV_PAYLOAD_VERSION

    def describe(self) -> str:
        """`2 layers, 2 KV heads x 32 (bfloat16, version 1)`."""
        return _describe(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.kv_version)


class KvPayloadMismatch(ValueError):
    """A KV payload this stage cannot read: another checkpoint, dtype or payload version, or arrays that do not
    match its own header. The message names the edge, the role and both sides."""


def _describe(layers: Any, heads: Any, head_dim: Any, dtype: Any, version: Any) -> str:
    return f"{layers} layers, {heads} KV heads x {head_dim} ({dtype}, version {version})"


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's part of a config.json (`TEXT_CONFIG_KEYS`, or an omni thinker's `text_config`)."""
    thinker = config.get("thinker_config")
    if isinstance(thinker, Mapping) and isinstance(thinker.get("text_config"), Mapping):
        return thinker["text_config"]
    for key in TEXT_CONFIG_KEYS:
        sub = config.get(key)
        if isinstance(sub, Mapping):
            return sub
    return config


def _kv_shape(text: Mapping[str, Any]) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of a text config; KeyError naming what it lacks."""
    for key in ("num_hidden_layers", "num_attention_heads"):
        if key not in text:
            raise KeyError(f"the text config has no {key!r}; it is not a transformer LM config")
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    return int(text["num_hidden_layers"]), kv_heads, head_dim


def kv_model_fingerprint(config: Mapping[str, Any], *, dtype: str) -> str:
    """The fingerprint that decides KV compatibility (see the module docstring), e.g.
    `Qwen2ForCausalLM/2L/2x32/bfloat16/9c1d5f0a3b2e4d6f`."""
    text = text_config(config)
    layers, kv_heads, head_dim = _kv_shape(text)
    arch = (config.get("architectures") or ["unknown"])[0]
    stable = {k: v for k, v in text.items() if k not in _VOLATILE_KEYS}
    digest = hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{arch}/{layers}L/{kv_heads}x{head_dim}/{dtype}/{digest}"


def kv_expectation(config: Mapping[str, Any], *, dtype: str) -> KvExpectation:
    """What a stage serving the checkpoint of `config` (config.json, parsed) at `dtype` accepts."""
    layers, kv_heads, head_dim = _kv_shape(text_config(config))
    return KvExpectation(kv_model_fingerprint(config, dtype=dtype), layers, kv_heads, head_dim, dtype)


def dtype_name(array: Any) -> str:
    """The dtype of a torch tensor or numpy array as torch names it without `torch.` (`bfloat16`, `float32`)."""
    return str(array.dtype).removeprefix("torch.")


def make_kv_payload(
    keys: Array, values: Array, *, model: str, positions: Sequence[int], next_position: int | None = None
) -> KvCachePayload:
    """The payload of `keys` and `values` (tokens, layers, kv_heads, head_dim), both of one shape and dtype, with
    the rope position of each token (`next_position`: after the last, max + 1 unless given).

    Raises ValueError when the arrays or positions disagree."""
    shape = tuple(keys.shape)
    if len(shape) != 4 or tuple(values.shape) != shape:
        raise ValueError(
            f"KV keys {shape} and values {tuple(values.shape)} must share one shape (tokens, layers, kv_heads, "
            "head_dim)"
        )
    if dtype_name(keys) != dtype_name(values):
        raise ValueError(f"KV keys are {dtype_name(keys)} but values {dtype_name(values)}; use one dtype")
    if len(positions) != shape[0]:
        raise ValueError(f"{len(positions)} positions for {shape[0]} KV tokens; give one per token")
    pos = [int(p) for p in positions]
    return KvCachePayload(
        kv_version=KV_PAYLOAD_VERSION,
        model=model,
        num_layers=shape[1],
        num_kv_heads=shape[2],
        head_dim=shape[3],
        dtype=dtype_name(keys),
        seq_len=shape[0],
        positions=pos,
        next_position=int(next_position) if next_position is not None else (max(pos) + 1 if pos else 0),
        keys=keys,
        values=values,
    )


_HEADER = ("kv_version", "model", "num_layers", "num_kv_heads", "head_dim", "dtype", "seq_len", "positions")


def check_kv_payload(payload: Mapping[str, Any], expected: KvExpectation, *, role: str, edge: str) -> None:
    """Refuse a payload this stage cannot read: raises KvPayloadMismatch naming `edge` (`thinker->dit`), `role`
    (`primary`, `cfg_text`...) and both sides when its version, layer count, KV heads, head_dim, dtype or
    checkpoint differ from `expected`, or when its arrays and positions do not match its own header."""
    where = f"edge {edge}, role {role}"
    missing = [k for k in (*_HEADER, "next_position", "keys", "values") if k not in payload]
    if missing:
        raise KvPayloadMismatch(
            f"{where}: the KV payload lacks {missing} (version {payload.get('kv_version', '?')}); this stage reads "
            f"version {expected.kv_version}: run the same omnikube version on both stages"
        )
    got = (payload["num_layers"], payload["num_kv_heads"], payload["head_dim"], payload["dtype"])
    want = (expected.num_layers, expected.num_kv_heads, expected.head_dim, expected.dtype)
    if payload["kv_version"] != expected.kv_version or got != want:
        raise KvPayloadMismatch(
            f"{where}: payload from a checkpoint with {_describe(*got, payload['kv_version'])}, this stage expects "
            f"{expected.describe()}; serve both stages from the same checkpoint and dtype with one omnikube version "
            "(finish a rollout that mixes them first)"
        )
    if payload["model"] != expected.model:
        raise KvPayloadMismatch(
            f"{where}: payload from checkpoint {payload['model']!r}, this stage expects {expected.model!r}: the same "
            "shapes from another model config, whose KV would guide silently wrong; serve both stages from the "
            "same checkpoint"
        )
    seq_len = int(payload["seq_len"])
    header_shape = (seq_len, *got[:3])
    for name in ("keys", "values"):
        array = payload[name]
        shape, dtype = tuple(getattr(array, "shape", ())), dtype_name(array) if hasattr(array, "dtype") else "?"
        if shape != header_shape or dtype != payload["dtype"]:
            raise KvPayloadMismatch(
                f"{where}: the payload's header says {header_shape} {payload['dtype']} (tokens, layers, kv_heads, "
                f"head_dim) but its {name} are {shape} {dtype}; the producer or the connector broke it"
            )
    if len(payload["positions"]) != seq_len:
        raise KvPayloadMismatch(
            f"{where}: the payload has {len(payload['positions'])} positions for {seq_len} tokens; the producer "
            "broke it"
        )
