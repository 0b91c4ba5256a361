"""The image sizes a diffusion stage can draw, as it reports them to the router (`wire.Pong.image_bounds`).

A stage whose model bounds the size (BAGEL's `max_latent_size`: a side of at most max_latent_size x its latent
downsample) says so once loaded, so that the router refuses a size outside them with a 400 before any stage works
(BAGEL's thinker would otherwise prefill the contexts of an image its dit cannot draw).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ImageSizeBounds"]


@dataclass(frozen=True)
class ImageSizeBounds:
    """Sides from `multiple` to `max_side`, each a multiple of `multiple`."""

    max_side: int
    multiple: int

    def refusal(self, width: int, height: int, stage: str) -> str | None:
        """Why `width`x`height` cannot be drawn by `stage` (a sentence that says what to send), or None."""
        for label, side in (("width", width), ("height", height)):
            if not self.multiple <= side <= self.max_side or side % self.multiple:
                return (
                    f"size {width}x{height}: the {label} {side} is not drawable by stage {stage!r}, whose sides run "
                    f"from {self.multiple} to {self.max_side} in multiples of {self.multiple}; ask for a size in "
                    "those bounds"
                )
        return None
