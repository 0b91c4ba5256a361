"""transformers' own `generate()` of the tiny Qwen2.5-Omni: the anchor the staged pipeline is compared with.

Greedy thinker and talker, speaker Ethan, token2wav's noise seeded with 0 (as the token2wav engine does
for a request without `seed`). Two deviations, on purpose:

- transformers 5.19's `generate` drops the attention mask before the talker's forward, which then skips
  adding the codec pad / bos embeddings to the last two prefill positions and the talker's 3-D rope
  index (its positions, and at every decode step `cache length + rope delta`; the model was trained
  with both, transformers 4.5x and vLLM-Omni use them). The talker is handed an all-ones mask at every
  forward, which restores that path; our talker does the same. For text prompts the rope delta is 0.
- with an image, 5.19's `generate` passes `pixel_values` on to the talker's `generate`, which refuses
  it; it goes in as `thinker_pixel_values` (the thinker's alone), the grid stays shared as there.

Each result is kept on disk beside the tiny models (`<model cache>/.qwen25-reference/`), keyed by the
model's build stamp, this file's source, the torch and transformers versions and the call's arguments, so
a later session (or the other module) reads it instead of running transformers' generate() again; a
rebuilt model, a changed reference or another library version computes it afresh.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from servelib import tiny_model

from omni_runtime.tiny_models import read_stamp

__all__ = ["MEDIA_KINDS", "generate_media_reference", "generate_reference", "media_parts"]

MEDIA_KINDS = ("image", "audio")


MODEL = "tiny-qwen2-5-omni"


def _cached(call: str, args: Any, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`compute()`, or what it returned for the same key before (see the module docstring)."""
    import torch
    import transformers

    folder = tiny_model(MODEL)
    key = {
        "stamp": read_stamp(folder),
        "source": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "libraries": [torch.__version__, transformers.__version__],
        "call": call,
        "args": args,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=repr).encode()).hexdigest()[:32]
    file = folder.parent / ".qwen25-reference" / f"{call}-{digest}.pt"
    if file.is_file():
        return torch.load(file, weights_only=True)
    result = compute()
    file.parent.mkdir(exist_ok=True)
    partial = file.with_name(f"{file.name}.{os.getpid()}.partial")
    torch.save(result, partial)
    os.replace(partial, file)  # atomic: a concurrent reader sees a whole file or none
    return result


@functools.cache
def _model() -> tuple[Any, Any]:
    import torch
    from transformers import AutoProcessor, Qwen2_5OmniForConditionalGeneration

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = tiny_model("tiny-qwen2-5-omni")
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()

    def talker_mask(module, args, kwargs):
        if kwargs.get("attention_mask") is None:
            if kwargs.get("inputs_embeds") is not None:  # the prefill
                shape = kwargs["inputs_embeds"].shape[:2]
            else:  # a decode step: the cache and its one new position
                ids = kwargs["input_ids"]
                shape = (ids.shape[0], kwargs["past_key_values"].get_seq_length() + ids.shape[1])
            kwargs["attention_mask"] = torch.ones(shape, dtype=torch.long)
        return args, kwargs

    model.talker.register_forward_pre_hook(talker_mask, with_kwargs=True)
    model.token2wav.register_forward_pre_hook(lambda module, args: torch.manual_seed(0) and None)
    return AutoProcessor.from_pretrained(folder), model


def generate_reference(cases: list[tuple[str, int, int]]) -> list[dict[str, Any]]:
    """Per (user prompt, thinker max tokens, talker max codes): prompt ids, generated ids, codec codes,
    waveform, and the thinker's rows over prompt + generated tokens but the last (`embeds` = layer 0,
    `hidden` = last layer before the final norm, as vLLM's hidden-state route sends them). Each case is
    cached on disk on its own (see the module docstring)."""
    return [_cached("text", list(case), functools.partial(_generate_one, *case)) for case in cases]


def _generate_one(text: str, tokens: int, frames: int) -> dict[str, Any]:
    import torch

    processor, model = _model()
    tokenizer = processor.tokenizer
    codes: list[list[int]] = []
    hook = model.token2wav.register_forward_pre_hook(lambda module, args: codes.append(args[0][0].tolist()) and None)
    try:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        sequences, wav = model.generate(
            ids,
            speaker="Ethan",
            thinker_max_new_tokens=tokens,
            talker_max_new_tokens=frames,
            talker_do_sample=False,
        )
        pre: dict[str, Any] = {}
        norm = model.thinker.model.norm.register_forward_hook(lambda m, i, o, pre=pre: pre.__setitem__("x", i[0]))
        with torch.inference_mode():
            rows = model.thinker(input_ids=sequences[:, :-1], output_hidden_states=True)
        norm.remove()
    finally:
        hook.remove()
    return {
        "prompt": ids[0].tolist(),
        "tokens": sequences[0, ids.shape[1] :].tolist(),
        "codes": codes[-1],
        "wav": wav.reshape(-1),
        "embeds": rows.hidden_states[0][0],
        "hidden": pre["x"][0],
        "frames": frames,
    }


def media_parts() -> dict[str, Any]:
    """The media of the media prompts: a 64x48 red image (PIL) and 0.5 s of a 16 kHz sine (float32, on
    the 16-bit grid: a 16-bit WAV of it decodes to the same samples)."""
    import numpy as np
    from PIL import Image

    return {
        "image": Image.new("RGB", (64, 48), (200, 30, 30)),
        "audio": (np.round(np.sin(np.arange(8000) / 10) * 0.3 * 32768) / 32768).astype(np.float32),
    }


def generate_media_reference(
    kinds: tuple[str, ...], text: str, tokens: int, frames: int, waveform: bool = True
) -> dict[str, Any]:
    """`generate_reference` for one user turn of `kinds` media parts (in that order, from `media_parts`)
    then `text`; also `grids`, the media shapes as the thinker stage sends them (`media_grids`), and
    `logits`, the talker's codec logits of each step ([vocab] each). Without `waveform` token2wav (the
    slow part on CPU) is skipped and `wav` is None. Cached on disk (see the module docstring)."""
    args = [list(kinds), text, tokens, frames, waveform]
    return _cached("media", args, functools.partial(_generate_media, kinds, text, tokens, frames, waveform))


def _generate_media(kinds: tuple[str, ...], text: str, tokens: int, frames: int, waveform: bool) -> dict[str, Any]:
    import torch

    processor, model = _model()
    parts = media_parts()
    content = [{"type": kind} for kind in kinds] + [{"type": "text", "text": text}]
    chat = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    media = {"images": [parts["image"]]} if "image" in kinds else {}
    if "audio" in kinds:
        media["audio"] = [parts["audio"]]
    inputs = processor(text=[chat], return_tensors="pt", **media)
    thinker_inputs = {}
    if "pixel_values" in inputs:
        thinker_inputs["pixel_values"] = inputs.pop("pixel_values")
    codes: list[list[int]] = []
    logits: list[Any] = []
    hooks = [
        model.token2wav.register_forward_pre_hook(lambda module, args: codes.append(args[0][0].tolist()) and None),
        model.talker.codec_head.register_forward_hook(lambda m, i, o: logits.append(o[0, -1].clone()) and None),
    ]
    forward = model.token2wav.forward
    if not waveform:
        model.token2wav.forward = lambda code, **kwargs: torch.zeros(1)
    try:
        sequences, wav = model.generate(
            **inputs, **{f"thinker_{k}": v for k, v in thinker_inputs.items()}, speaker="Ethan",
            thinker_max_new_tokens=tokens, talker_max_new_tokens=frames, talker_do_sample=False,
        )  # fmt: skip
    finally:
        model.token2wav.forward = forward
        for hook in hooks:
            hook.remove()
    ids = inputs["input_ids"]
    pre: dict[str, Any] = {}
    norm = model.thinker.model.norm.register_forward_hook(lambda m, i, o, pre=pre: pre.__setitem__("x", i[0]))
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    with torch.inference_mode():  # the mask: without one the thinker skips its 3-D rope index (plain positions)
        ids_in = sequences[:, :-1]
        rows = model.thinker(input_ids=ids_in, attention_mask=torch.ones_like(ids_in), output_hidden_states=True,
                             **thinker_inputs, **extra)  # fmt: skip
    norm.remove()
    grids = {
        "image_grid_thw": inputs["image_grid_thw"].tolist() if "image_grid_thw" in inputs else [],
        "audio_feature_lengths": inputs["feature_attention_mask"].sum(-1).tolist()
        if "feature_attention_mask" in inputs
        else [],
    }
    return {
        "kinds": kinds,
        "prompt": ids[0].tolist(),
        "tokens": sequences[0, ids.shape[1] :].tolist(),
        "codes": codes[-1],
        "wav": wav.reshape(-1) if waveform else None,
        "embeds": rows.hidden_states[0][0],
        "hidden": pre["x"][0],
        "frames": frames,
        "grids": grids,
        "logits": logits,
    }
