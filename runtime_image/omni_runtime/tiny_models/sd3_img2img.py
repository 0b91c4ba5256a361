"""`tiny-sd3-img2img`: the tiny SD3 pipeline as an image-to-image model (for `/v1/images/edits`).

The same components as `tiny-sd3` (copied from its finished build); only `model_index.json` names
`StableDiffusion3Img2ImgPipeline`, which selects the registry pipeline `stable-diffusion-3-img2img`
(a diffusion stage that takes text and an image).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from omni_runtime.tiny_models import sd3
from omni_runtime.tiny_models._build import STAMP_FILE

NAME = "tiny-sd3-img2img"
VERSION = "1"
PIPELINE_CLASS = "StableDiffusion3Img2ImgPipeline"


def build(out: Path, sd3_model: Path) -> None:
    """Fill the empty folder `out` from a finished `tiny-sd3` build."""
    shutil.copytree(sd3_model, out, ignore=shutil.ignore_patterns(STAMP_FILE), dirs_exist_ok=True)
    index_file = out / "model_index.json"
    index = json.loads(index_file.read_text())
    if index.get("_class_name") != sd3.PIPELINE_CLASS:
        raise RuntimeError(f"{sd3_model} is not a {sd3.PIPELINE_CLASS} build: {index.get('_class_name')!r}")
    index["_class_name"] = PIPELINE_CLASS
    index_file.write_text(json.dumps(index, indent=2) + "\n")
