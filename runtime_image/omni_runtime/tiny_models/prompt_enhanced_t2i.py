"""`tiny-prompt-enhanced-t2i`: the AR -> DiT pair of a prompt-enhancer pipeline, as one plain folder.

    tiny-prompt-enhanced-t2i/
        omnikube_pipeline.json   {"pipeline": "prompt-enhanced-t2i", "stages": {...}, ...}
        enhancer/                a copy of tiny-qwen2-chat (config.json: Qwen2ForCausalLM) -> vLLM
        dit/                     a copy of tiny-sd3 (model_index.json: StableDiffusion3Pipeline) -> diffusers

The root has neither config.json nor model_index.json, so nothing resolves it by architecture: the
marker file names the registry pipeline explicitly, and each stage's `model_subfolder` (`enhancer`,
`dit`) is an ordinary model folder that its engine loads on its own. The copies are byte-identical
to the standalone builds in the same cache.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from omni_runtime.tiny_models import qwen2_chat, sd3
from omni_runtime.tiny_models._build import STAMP_FILE

__all__ = ["MARKER_FILE", "NAME", "PIPELINE", "VERSION", "build", "marker"]

NAME = "tiny-prompt-enhanced-t2i"
VERSION = f"1+{qwen2_chat.NAME}@{qwen2_chat.VERSION}+{sd3.NAME}@{sd3.VERSION}"
"""Changes when this layout or either component changes, so the copy never goes stale."""

PIPELINE = "prompt-enhanced-t2i"
MARKER_FILE = "omnikube_pipeline.json"


def marker() -> dict:
    """The contents of `omnikube_pipeline.json`."""
    return {
        "pipeline": PIPELINE,
        "description": "A chat model rewrites the user's prompt; a diffusion pipeline draws it.",
        "stages": {
            "enhancer": {
                "model_subfolder": "enhancer",
                "kind": "ar",
                "architectures": ["Qwen2ForCausalLM"],
                "built_from": f"{qwen2_chat.NAME}@{qwen2_chat.VERSION}",
            },
            "dit": {
                "model_subfolder": "dit",
                "kind": "diffusion",
                "diffusers_class": sd3.PIPELINE_CLASS,
                "built_from": f"{sd3.NAME}@{sd3.VERSION}",
            },
        },
    }


def build(out: Path, chat_model: Path, diffusion_model: Path) -> None:
    """Fill the empty folder `out` from finished builds of the two components."""
    skip = shutil.ignore_patterns(STAMP_FILE)
    shutil.copytree(chat_model, out / "enhancer", ignore=skip)
    shutil.copytree(diffusion_model, out / "dit", ignore=skip)
    (out / MARKER_FILE).write_text(json.dumps(marker(), indent=2) + "\n")
