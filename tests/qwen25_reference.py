"""transformers' own `generate()` of the tiny Qwen2.5-Omni: the anchor the staged pipeline is compared with.

Greedy thinker and talker, speaker Ethan, token2wav's noise seeded with 0 (as the token2wav engine does
for a request without `seed`). One deviation, on purpose: transformers 5.19's `generate` drops the
attention mask before the talker's forward, which then skips adding the codec pad / bos embeddings to
the last two prefill positions (the model was trained with them; transformers 4.5x added them). The
talker is handed an all-ones mask at its prefill, which restores that path; our talker adds them too.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from servelib import tiny_model

__all__ = ["generate_reference"]


@functools.cache
def _model() -> tuple[Any, Any]:
    import torch
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = tiny_model("tiny-qwen2-5-omni")
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()

    def talker_mask(module, args, kwargs):
        if kwargs.get("inputs_embeds") is not None and kwargs.get("attention_mask") is None:
            kwargs["attention_mask"] = torch.ones(kwargs["inputs_embeds"].shape[:2], dtype=torch.long)
        return args, kwargs

    model.talker.register_forward_pre_hook(talker_mask, with_kwargs=True)
    model.token2wav.register_forward_pre_hook(lambda module, args: torch.manual_seed(0) and None)
    return AutoTokenizer.from_pretrained(folder), model


def generate_reference(cases: list[tuple[str, int, int]]) -> list[dict[str, Any]]:
    """Per (user prompt, thinker max tokens, talker max codes): prompt ids, generated ids, codec codes,
    waveform, and the thinker's rows over prompt + generated tokens but the last (`embeds` = layer 0,
    `hidden` = last layer before the final norm, as vLLM's hidden-state route sends them)."""
    import torch

    tokenizer, model = _model()
    codes: list[list[int]] = []
    hook = model.token2wav.register_forward_pre_hook(lambda module, args: codes.append(args[0][0].tolist()) and None)
    out = []
    try:
        for text, tokens, frames in cases:
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
            out.append(
                {
                    "prompt": ids[0].tolist(),
                    "tokens": sequences[0, ids.shape[1] :].tolist(),
                    "codes": codes[-1],
                    "wav": wav.reshape(-1),
                    "embeds": rows.hidden_states[0][0],
                    "hidden": pre["x"][0],
                    "frames": frames,
                }
            )
    finally:
        hook.remove()
    return out
