"""Check (not a benchmark): tiny-bagel's generation path on a GPU draws what it draws on the CPU.

    python3 bench/bagel_device_check.py [--device cuda]

CI has no GPU, so a tensor left on the CPU by the BAGEL engine (the seeded noise, a position table) is found
only here: the same seeded text-to-image and edit, in float32 on the CPU and on `--device`, and the mean pixel
difference between them (float32 on both: differences are kernel rounding, far below one grey level).
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np
import torch
from PIL import Image

from omni_runtime.engines.diffusion.bagel import BagelGenerator
from omni_runtime.spec.guidance import BagelGuidance
from omni_runtime.tiny_models import ensure


def draw(path, device: str) -> tuple[np.ndarray, np.ndarray]:
    generator = BagelGenerator.from_pretrained(path, torch.float32, device=device)
    guidance = BagelGuidance(cfg_text_scale=4.0)
    contexts = {
        "primary": generator.prefill(generator.frame_text([11, 12, 13, 14])),
        "cfg_text": generator.prefill(generator.frame_text([])),
    }
    t2i = generator.generate(contexts, 64, 64, 4, 3, guidance)
    picture = Image.fromarray(np.random.default_rng(1).integers(0, 256, (50, 70, 3), dtype=np.uint8))
    image = generator.prepare_edit(picture)
    edit_contexts = generator.edit_contexts(image, [21, 22, 23], seed=3)
    height, width = image.size
    edit_guidance = BagelGuidance(cfg_text_scale=4.0, cfg_img_scale=2.0, cfg_renorm_type="text_channel")
    edited = generator.generate(edit_contexts, height, width, 4, 3, edit_guidance)
    return t2i, edited


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        path = ensure("tiny-bagel", cache)
        cpu, there = draw(path, "cpu"), draw(path, args.device)
    for name, a, b in (("text-to-image", cpu[0], there[0]), ("edit", cpu[1], there[1])):
        diff = float(np.abs(a.astype(float) - b.astype(float)).mean())
        print(f"tiny-bagel {name} {a.shape}: cpu vs {args.device} mean |difference| {diff:.3f} of 255")


if __name__ == "__main__":
    main()
